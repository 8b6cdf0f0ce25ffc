"""An EAGLE-3 head (Li et al. 2025) as upstream runs it, and its training-time-test forward pass.

The head reads the target's features f_i (the residual stream after three target layers, export/features.py) and
the embedding of the next token, and predicts the token after it:

    row i, step 0:  hidden = fc(f_i)                       [3H -> H]
                    x      = [input_layernorm(E[t_{i+1}]), hidden_norm(hidden)]     [2H: q/k/v read 2H]
                    r      = hidden + o_proj(attention(x))          (one Llama layer, own KV over earlier rows)
                    g_i    = r + mlp(post_attention_layernorm(r))   (the "pre-norm" state, fed to the next step)
                    q(t_{i+2}) = softmax(lm_head(norm(g_i)))        over the draft vocabulary (d2t maps to target ids)

Step k > 0 of the same row drafts one position further on the head's own state: hidden = g_i of step k-1 (no fc),
token t_{i+k+1}, position i+k. This is what TensorRT-LLM (tensorrt_llm/_torch/models/modeling_speculative.py
@b35ac1b64368513d215c57d2ed01d62d910df8da, Eagle3DecoderLayer / Eagle3DraftModel / apply_eagle3_fc: fc only when
the width is not H) and vLLM (vllm/model_executor/models/llama_eagle3.py @583507d13075783a12ccbd774575974d10ca4959)
run. Training-time test unrolls those steps in training: at step k a row's query attends to step 0's keys of rows
<= i (the context, made from target features) and to its own keys of steps 1..k (the draft positions i+1..i+k it
wrote), exactly the keys it sees while drafting. Teacher rows: step k of row i is taught the target's distribution
over t_{i+k+2}, i.e. teacher row i+k+1.

Draft vocabulary (FR-Spec): the head scores `draft_vocab_size` target tokens; d2t[d] = target_id - d (upstream's
offset form: target = d + d2t[d]), t2d[v] = whether target token v is in the draft vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class HeadShape:
    """The head's geometry: the target's width, attention and MLP shape, and the draft vocabulary."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    feature_layers: tuple[int, ...]  # layer-output ids (export/features.py)

    @classmethod
    def from_target(cls, config, feature_layers: Sequence[int], draft_vocab_size: int) -> "HeadShape":
        heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            rope_theta=float(getattr(config, "rope_theta", 10000.0)),
            max_position_embeddings=int(getattr(config, "max_position_embeddings", 2048)),
            vocab_size=config.vocab_size,
            draft_vocab_size=int(draft_vocab_size),
            feature_layers=tuple(int(i) for i in feature_layers),
        )


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    """Llama attention whose q/k/v read 2H (EAGLE-3): names as upstream's checkpoints spell them."""

    def __init__(self, shape: HeadShape):
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.heads, self.kv_heads, self.head_dim = shape.num_attention_heads, shape.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)


class MLP(nn.Module):
    def __init__(self, shape: HeadShape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, shape: HeadShape):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)  # on fc(features) / the previous step's state
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)


class Eagle3HeadModule(nn.Module):
    """The head's modules, named as in upstream's checkpoints: fc, midlayer.*, norm, lm_head, d2t, t2d."""

    def __init__(self, shape: HeadShape):
        super().__init__()
        self.shape = shape
        h = shape.hidden_size
        self.fc = nn.Linear(h * len(shape.feature_layers), h, bias=False)
        self.midlayer = MidLayer(shape)
        self.norm = RMSNorm(h, shape.rms_norm_eps)
        self.lm_head = nn.Linear(h, shape.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(shape.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(shape.vocab_size, dtype=torch.bool))
        inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, shape.head_dim, 2).float() / shape.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    # ---- vocabulary maps ----
    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """token_ids: [draft_vocab_size] sorted target ids the head scores."""
        token_ids = token_ids.long().to(self.d2t.device)
        self.d2t.copy_(token_ids - torch.arange(len(token_ids), device=token_ids.device))
        self.t2d.zero_()
        self.t2d[token_ids] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft index of each target id; -1 where the draft vocabulary lacks it."""
        index = torch.cumsum(self.t2d.long(), 0) - 1
        return torch.where(self.t2d[target_ids], index[target_ids], torch.full_like(target_ids, -1))

    # ---- the forward pass ----
    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, heads, n, d], positions [B, n] (HF Llama's rotate-half convention)."""
        angles = positions[:, None, :, None].float() * self.inv_freq  # [B, 1, n, d/2]
        cos, sin = torch.cat([angles, angles], -1).cos().to(x.dtype), torch.cat([angles, angles], -1).sin().to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        attn = self.midlayer.self_attn
        b, n, _ = x.shape
        q = attn.q_proj(x).view(b, n, attn.heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, n, attn.kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, n, attn.kv_heads, attn.head_dim).transpose(1, 2)
        k = k.repeat_interleave(attn.heads // attn.kv_heads, dim=1)
        v = v.repeat_interleave(attn.heads // attn.kv_heads, dim=1)
        return self._rope(q, positions), self._rope(k, positions), v

    def unrolled(self, features: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test: the pre-norm states g of every row at steps 0..steps-1 (module docstring).

        features [B, n, 3H] (f_0..f_{n-1}); tokens [B, n + steps - 1]: tokens[:, i + k] is the token row i reads at
        step k (t_{i+k+1}: the sequence shifted by one); valid [B, n]: rows that exist (right padding).
        Returns `steps` tensors [B, n, H]."""
        mid = self.midlayer
        b, n, _ = features.shape
        rows = torch.arange(n, device=features.device)
        causal = (rows[None, :] <= rows[:, None])[None, None] & valid[:, None, None, :]  # [B, 1, n(query), n(key)]
        scale = 1.0 / math.sqrt(mid.self_attn.head_dim)
        hidden = self.fc(features)
        keys0 = values0 = None
        own_keys, own_values, states = [], [], []
        for step in range(steps):
            positions = (rows + step)[None].expand(b, n)
            embeds = self._embed(tokens[:, step : step + n])
            x = torch.cat([mid.input_layernorm(embeds), mid.hidden_norm(hidden)], dim=-1)
            q, k, v = self._qkv(x, positions)
            if step == 0:
                keys0, values0 = k, v
            else:
                own_keys.append(k)
                own_values.append(v)
            context = (q @ keys0.transpose(-1, -2)) * scale  # [B, heads, n, n]
            context = context.masked_fill(~causal, float("-inf"))
            diagonal = [((q * key).sum(-1, keepdim=True) * scale) for key in own_keys]  # each [B, heads, n, 1]
            weights = torch.softmax(torch.cat([context, *diagonal], dim=-1).float(), dim=-1).to(q.dtype)
            out = weights[..., :n] @ values0
            for j, value in enumerate(own_values):
                out = out + weights[..., n + j : n + j + 1] * value
            out = out.transpose(1, 2).reshape(b, n, -1)
            residual = hidden + mid.self_attn.o_proj(out)
            state = residual + mid.mlp(mid.post_attention_layernorm(residual))
            states.append(state)
            hidden = state
        return states

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """[..., H] pre-norm state -> [..., draft_vocab_size] logits."""
        return self.lm_head(self.norm(state))

    # The target's embedding is not part of the head (upstream heads carry no embed_tokens): it is attached as a
    # frozen, non-persistent buffer, so it follows the head across devices and stays out of its state_dict.
    def attach_embedding(self, weight: torch.Tensor) -> None:
        self.register_buffer("target_embedding", weight.detach().float().clone().to(self.d2t.device), persistent=False)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(token_ids, self.target_embedding)


def make_head(target, *, feature_layers: Sequence[int], draft_token_ids: torch.Tensor, warm_start: bool,
              warm_attention: bool, seed: int) -> Eagle3HeadModule:
    """A head for `target` (a transformers Llama-family causal LM) over the draft vocabulary `draft_token_ids`.

    warm_start: lm_head rows are the target's head rows of the draft tokens, the final norm is the target's, the
    MLP with its norm is a copy of the target's last layer's (the state the head writes feeds a norm and a head
    like the target's last layer output does), and fc passes the deepest feature layer through (identity on its
    block, plus the random init): the residual stream starts as the target's own, at a scale the copied MLP and norm
    expect (held-out position 1 after 60k training tokens: 0.32 against 0.275 without it, docs/eagle3.md).
    warm_attention (with warm_start): the attention is the last layer's too, on the hidden half of its 2H input
    (hidden_norm, the hidden columns of q/k/v, o_proj), so the head starts as the target's last layer over the deepest
    feature (docs/eagle3.md 3q measures what it buys); it needs warm_start (ValueError otherwise). Otherwise every
    weight is random (norms at one)."""
    if warm_attention and not warm_start:
        raise ValueError("warm_attention copies the target's attention onto the warm start's fc: it needs warm_start")
    torch.manual_seed(seed)
    shape = HeadShape.from_target(target.config, feature_layers, len(draft_token_ids))
    head = Eagle3HeadModule(shape)
    std = getattr(target.config, "initializer_range", 0.02)
    for module in head.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
    head.set_draft_vocab(torch.as_tensor(draft_token_ids))
    head.attach_embedding(target.get_input_embeddings().weight)
    if warm_start:
        with torch.no_grad():
            head.lm_head.weight.copy_(target.get_output_embeddings().weight.detach().float()[torch.as_tensor(draft_token_ids)])
            head.norm.weight.copy_(target.model.norm.weight.detach().float())
            width = shape.hidden_size
            head.fc.weight[:, -width:] += torch.eye(width)
            last = target.model.layers[-1]
            head.midlayer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight.detach().float())
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(head.midlayer.mlp, name).weight.copy_(getattr(last.mlp, name).weight.detach().float())
            if warm_attention:
                # The hidden half of q/k/v reads hidden_norm(fc(f)), the deepest feature at first: the last layer's own
                # input norm and projections on it, its o_proj back; the embedding half keeps its random init.
                head.midlayer.hidden_norm.weight.copy_(last.input_layernorm.weight.detach().float())
                for name in ("q_proj", "k_proj", "v_proj"):
                    getattr(head.midlayer.self_attn, name).weight[:, width:].copy_(
                        getattr(last.self_attn, name).weight.detach().float())
                head.midlayer.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight.detach().float())
    return head


def head_vocab_size(folder: Path, feature_layers: Optional[Sequence[int]] = None) -> int:
    """The draft vocabulary size of the head written in `folder` (its config.json), for --init-head; refused in one
    line when `folder` is not such a head, or names other target layers than `feature_layers`. Cheap: called before
    the teacher pass."""
    from specpipe.checkpoint.eagle3 import read_eagle3_head
    from specpipe.errors import UsageError

    info = read_eagle3_head(str(folder))
    if info is None or not info.draft_vocab_size:
        raise UsageError(f"--init-head: {folder} is not an EAGLE-3 head with a draft vocabulary (config.json naming "
                         "LlamaForCausalLMEagle3 and draft_vocab_size)")
    if feature_layers is not None and info.layers_to_capture is not None and \
            tuple(info.layers_to_capture) != tuple(feature_layers):
        raise UsageError(f"--init-head: {folder} reads target layers {list(info.layers_to_capture)}, this run "
                         f"{list(feature_layers)}")
    return info.draft_vocab_size


def load_head_weights(head: Eagle3HeadModule, folder: Path) -> None:
    """Continue from a written head (upstream's format, checkpoint/eagle3.py): its every tensor, its draft vocabulary
    included, replaces `head`'s. Refused in one line when it was made for another shape (target width, feature
    layers, draft vocabulary size): such a head cannot read this target's features."""
    from safetensors.torch import load_file

    from specpipe.checkpoint.eagle3 import WEIGHTS_FILE, read_eagle3_head
    from specpipe.errors import UsageError

    info = read_eagle3_head(str(folder))
    if info is None or not (Path(folder) / WEIGHTS_FILE).is_file():
        raise UsageError(f"--init-head: {folder} is not an EAGLE-3 head (config.json naming LlamaForCausalLMEagle3 + "
                         f"{WEIGHTS_FILE})")
    if info.layers_to_capture is not None and tuple(info.layers_to_capture) != tuple(head.shape.feature_layers):
        raise UsageError(f"--init-head: {folder} reads target layers {list(info.layers_to_capture)}, this run "
                         f"{list(head.shape.feature_layers)}")
    tensors = load_file(str(Path(folder) / WEIGHTS_FILE))
    own = head.state_dict()
    wrong = [name for name in own if name not in tensors or tuple(tensors[name].shape) != tuple(own[name].shape)]
    if wrong:
        raise UsageError(f"--init-head: {folder} does not fit this target's head (first mismatch: {wrong[0]}, "
                         f"{tuple(tensors[wrong[0]].shape) if wrong[0] in tensors else 'missing'} vs "
                         f"{tuple(own[wrong[0]].shape)})")
    with torch.no_grad():
        head.load_state_dict({name: tensors[name].to(own[name].dtype) for name in own}, strict=True)


def step_weights(steps: int, decay: float) -> list[float]:
    """Per-step loss weights decay^k (EAGLE-3 / SpecForge weight later steps less), normalized to sum to 1."""
    raw = [decay**k for k in range(steps)]
    return [w / sum(raw) for w in raw]


def valid_rows(lengths: torch.Tensor, n: int, device: Optional[torch.device] = None) -> torch.Tensor:
    return torch.arange(n, device=device)[None, :] < lengths.to(device)[:, None]
