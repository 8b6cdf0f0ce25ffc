"""The torch teacher's grouped-query attention (specpipe/distill/grouped_attention.py) computes eager attention: the
same logits on a left-padded batch, prompt and cached steps alike, and the torch teachers attend with it."""

from __future__ import annotations

import copy

import pytest
import torch


@pytest.fixture(scope="module")
def model(tiny_target):
    from specpipe.checkpoint import load_causal_lm

    loaded = load_causal_lm(tiny_target)
    assert loaded.config.num_attention_heads > loaded.config.num_key_value_heads > 1  # query heads share key/values
    return loaded


def _left_padded(rows: list[list[int]], pad: int = 0):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


@torch.inference_mode()
def _logits_of_a_prompt_then_cached_steps(model, rows, steps):
    """Logits at the real positions of a left-padded prompt call, then of each cached call of `steps` (token lists of
    1 or more per row): [real prompt positions + every step's positions, vocab]."""
    ids, mask = _left_padded(rows)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    kept = [out.logits[mask.bool()]]
    cache, next_pos = out.past_key_values, positions[:, -1:] + 1
    for step in steps:
        new = torch.tensor(step)  # [rows, n]
        mask = torch.cat([mask, torch.ones_like(new)], dim=1)
        step_positions = next_pos + torch.arange(new.shape[1])
        out = model(input_ids=new, attention_mask=mask, position_ids=step_positions, past_key_values=cache,
                    use_cache=True)
        kept.append(out.logits.reshape(-1, out.logits.shape[-1]))
        cache, next_pos = out.past_key_values, step_positions[:, -1:] + 1
    return torch.cat(kept)


def test_grouped_attention_gives_eager_attentions_logits(model):
    """Three prompts of different lengths (left padding the mask must hide), then a 1-token and a 3-token cached call:
    every real position's logits as eager attention gives them, to float rounding."""
    from specpipe.distill.grouped_attention import NAME, use_grouped_attention

    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    grouped = copy.deepcopy(model)
    use_grouped_attention(grouped)
    assert grouped.config._attn_implementation == NAME
    rows = [[1, 17, 40, 23, 99, 5, 61], [1, 8, 230], [1, 77, 3, 45, 12]]
    steps = [[[7], [9], [11]], [[30, 31, 32], [40, 41, 42], [50, 51, 52]]]
    expected = _logits_of_a_prompt_then_cached_steps(eager, rows, steps)
    got = _logits_of_a_prompt_then_cached_steps(grouped, rows, steps)
    assert got.shape == expected.shape == (7 + 3 + 5 + 3 + 9, model.config.vocab_size)
    assert torch.allclose(got, expected, atol=1e-4, rtol=0), float((got - expected).abs().max())
    # the padding matters here: the same rows without their left padding give those logits too
    for i, row in enumerate(rows):
        alone = _logits_of_a_prompt_then_cached_steps(eager, [row], [[s[i]] for s in steps])
        start = sum(len(r) for r in rows[:i])
        assert torch.allclose(got[start : start + len(row)], alone[: len(row)], atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_torch_teachers_attend_with_grouped_attention(model, dtype):
    """Teachers.torch_model makes every torch teacher (fp32, which is the run's own model on a CPU, and the copies in
    other dtypes) attend with grouped attention, its answers keep the records' shape, and release() gives the run's
    model its own attention back."""
    from specpipe.distill.grouped_attention import NAME
    from specpipe.distill.teacher import answer_prompts
    from specpipe.distill.teachers import Teachers

    own = copy.deepcopy(model)
    before = own.config._attn_implementation
    teachers = Teachers(own, torch.device("cpu"))
    teacher = teachers.torch_model(dtype)
    assert teacher.config._attn_implementation == NAME
    assert (teacher is own) == (dtype == "float32")
    assert next(teacher.parameters()).dtype == getattr(torch, dtype)
    prompts = [[1, 17, 40, 23, 99], [1, 8, 230]]
    records = answer_prompts(teacher, prompts, kinds=["code", "chat"], max_new_tokens=4, eos_token_ids=set(),
                             pad_token_id=0, top_k=8)
    for record, prompt in zip(records, prompts):
        assert record.token_ids[: len(prompt)].tolist() == prompt and len(record) == len(prompt) + 4
        assert record.top_ids.shape == (len(record) - 1, 8)
    teachers.release()  # the run's own model attends as it did before it was lent as the fp32 teacher
    assert own.config._attn_implementation == before != NAME
