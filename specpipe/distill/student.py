"""The draft model a distillation starts from: a small Llama that shares the target's vocabulary.

Its cost per token is dominated by the vocabulary head (V x width weights read per token), so the
width is the main speed knob; layers are cheap at small widths. The embedding (tied to the head when
the target's is) starts as the target's own embedding projected onto its top `width` principal
directions, so the draft begins with the target's notion of which tokens are alike.
"""

from __future__ import annotations

import torch


def _divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= max(1, limit))


def student_config(target_config, *, layers: int, width: int):
    """A LlamaConfig for the draft: the target's vocabulary, special ids and positions; its own size."""
    from transformers import LlamaConfig

    t = target_config
    target_width = t.hidden_size
    head_dim = getattr(t, "head_dim", None) or target_width // t.num_attention_heads
    heads = max(1, width // head_dim) if width % head_dim == 0 else _divisor_at_most(width, width // 32)
    head_dim = width // heads
    group = max(1, t.num_attention_heads // (getattr(t, "num_key_value_heads", None) or t.num_attention_heads))
    kv_heads = _divisor_at_most(heads, max(1, heads // min(group, 2)))
    mlp_ratio = (getattr(t, "intermediate_size", None) or 4 * target_width) / target_width
    return LlamaConfig(
        vocab_size=t.vocab_size,
        hidden_size=width,
        intermediate_size=int(round(width * mlp_ratio / 32)) * 32,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_act=getattr(t, "hidden_act", "silu"),
        max_position_embeddings=getattr(t, "max_position_embeddings", 2048),
        rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
        rope_theta=getattr(t, "rope_theta", 10000.0),
        tie_word_embeddings=bool(getattr(t, "tie_word_embeddings", False)),
        bos_token_id=t.bos_token_id,
        eos_token_id=t.eos_token_id,
        pad_token_id=getattr(t, "pad_token_id", None),
        initializer_range=0.02,
        torch_dtype="float32",
    )


def principal_directions(matrix: torch.Tensor, width: int) -> torch.Tensor:
    """[hidden, width]: the top right-singular vectors of `matrix` [rows, hidden]."""
    _, _, vh = torch.linalg.svd(matrix.float(), full_matrices=False)
    return vh[:width].T.contiguous()


def make_student(target, *, layers: int, width: int, seed: int):
    """A fresh draft for `target` (a transformers causal LM). width 0 = the target's width, whose embedding,
    head and final norm are then copied as they are, and whose layers start as evenly spaced target layers."""
    from transformers import LlamaForCausalLM

    target_width = target.config.hidden_size
    width = width or target_width
    torch.manual_seed(seed)
    student = LlamaForCausalLM(student_config(target.config, layers=layers, width=width)).float()
    target_embed = target.get_input_embeddings().weight.detach().float()
    target_head = target.get_output_embeddings().weight.detach().float()
    with torch.no_grad():
        if width == target_width:
            student.get_input_embeddings().weight.copy_(target_embed)
            if not student.config.tie_word_embeddings:
                student.get_output_embeddings().weight.copy_(target_head)
            _copy_layers(target, student)
        else:
            _copy_projected(student.get_input_embeddings().weight, target_embed)
            if not student.config.tie_word_embeddings:
                _copy_projected(student.get_output_embeddings().weight, target_head)
    return student.eval()


def _copy_projected(student_weight: torch.Tensor, target_weight: torch.Tensor) -> None:
    """student_weight [V, width] <- target_weight [V, hidden] on its top principal directions; a draft wider
    than the target keeps its random init in the columns beyond the target's width."""
    rank = min(student_weight.shape[1], target_weight.shape[1])
    student_weight[:, :rank] = target_weight @ principal_directions(target_weight, rank)


def _copy_layers(target, student) -> None:
    """Same width: start from target layers spread over its depth (first and last included), and its final norm."""
    target_layers = target.model.layers
    n, m = len(target_layers), len(student.model.layers)
    picks = [round(i * (n - 1) / max(1, m - 1)) for i in range(m)]
    for student_layer, index in zip(student.model.layers, picks):
        try:
            student_layer.load_state_dict(target_layers[index].state_dict())
        except RuntimeError:
            return  # the target is not Llama-shaped: keep the random layers
    student.model.norm.load_state_dict(target.model.norm.state_dict())


def draft_cost_ratio(student_config, target_config) -> float:
    """Weights read per token, draft / target: the first-order cost of one decode step on a
    memory-bound CPU (embedding rows are gathered, not read whole, so they do not count)."""

    def per_token_params(c) -> int:
        width, inter = c.hidden_size, c.intermediate_size
        head_dim = getattr(c, "head_dim", None) or width // c.num_attention_heads
        attn = width * head_dim * (2 * c.num_attention_heads + 2 * (c.num_key_value_heads or c.num_attention_heads))
        return c.num_hidden_layers * (attn + 3 * width * inter) + c.vocab_size * width

    return per_token_params(student_config) / per_token_params(target_config)
