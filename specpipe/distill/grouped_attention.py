"""Grouped-query attention for the torch teacher: each key/value head is read once by its group of query heads.

transformers' eager and SDPA attention (4.57, `repeat_kv`) copy every key/value head once per query head of its group
when a padding mask is given (SDPA's `enable_gqa` is used only without one), and the teacher's batches are
left-padded: on SmolLM2-135M (9 query heads over 3 key/value heads) that copy was a third of a bf16 teacher step
(48 rows, AMX; docs/eagle3.md 3w). Here the query heads of a group are stacked along the query axis instead, so the
products read the cached keys and values in place. The arithmetic is eager attention's (scores, additive mask, fp32
softmax, weighted sum).
"""

from __future__ import annotations

from typing import Optional

import torch

NAME = "specpipe_grouped"
# Model types whose attention in transformers 4.57 is eager attention and nothing more (no logit soft-capping, no
# attention sinks; a sliding window is in the mask): grouped attention computes theirs. Others keep eager attention.
PLAIN_ATTENTION = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def grouped_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch, heads, q_len, head_dim]
    key: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    value: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    attention_mask: Optional[torch.Tensor],  # [batch, 1, q_len, >= kv_len] additive, or None
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns ([batch, q_len, heads, head_dim], None).

    Query head h reads key/value head h // groups (transformers' order), so viewing [batch, heads, q_len, d] as
    [batch, kv_heads, groups * q_len, d] puts each group's queries beside one another: e.g. 9 heads over 3, q_len 2:
    row 0 of kv head 1 is query head 3 at position 0, row 1 head 3 at position 1, row 2 head 4 at position 0, ..."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    stacked = query.reshape(batch, kv_heads, groups * q_len, head_dim)
    scores = torch.matmul(stacked, key.transpose(2, 3)) * scaling  # [batch, kv_heads, groups * q_len, kv_len]
    if attention_mask is not None:
        scores = scores.view(batch, kv_heads, groups, q_len, kv_len) + attention_mask[:, :, None, :, :kv_len]
        scores = scores.view(batch, kv_heads, groups * q_len, kv_len)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).view(batch, heads, q_len, head_dim)
    return out.transpose(1, 2).contiguous(), None


def use_grouped_attention(model) -> bool:
    """Make a transformers model of PLAIN_ATTENTION's types attend with grouped_attention_forward (True); leave any
    other as it is (False)."""
    if model.config.model_type not in PLAIN_ATTENTION:
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, grouped_attention_forward)
    AttentionMaskInterface.register(NAME, eager_mask)  # the additive float mask eager attention takes
    model.set_attn_implementation(NAME)
    return True
