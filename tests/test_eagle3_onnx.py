"""The EAGLE-3 head as an ONNX Runtime graph (engines/eagle3_onnx.py) computes what the torch head computes.

The torch head (engines/eagle3_head.py, fp32) is the reference: the same random head, the same calls (context rows,
draft steps, truncation as the drafter does it, a cache grown past its first capacity), the logits, the state and
the cached keys compared. A graph built with the wrong rotary base must fail the same comparison.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specpipe.checkpoint.eagle3 import head_config, write_eagle3_head
from specpipe.engines import eagle3_onnx
from specpipe.drafts.eagle3 import open_head

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, DRAFT_VOCAB = 64, 4, 2, 16, 96, 300, 120


@pytest.fixture(scope="module")
def head_folder(tmp_path_factory):
    generator = torch.Generator().manual_seed(0)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=generator) * scale

    draft_ids = torch.sort(torch.randperm(VOCAB, generator=generator)[:DRAFT_VOCAB]).values
    tensors = {
        "fc.weight": rand(HIDDEN, 3 * HIDDEN),
        "midlayer.input_layernorm.weight": 1 + rand(HIDDEN, scale=0.1),
        "midlayer.hidden_norm.weight": 1 + rand(HIDDEN, scale=0.1),
        "midlayer.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
        "midlayer.post_attention_layernorm.weight": 1 + rand(HIDDEN, scale=0.1),
        "midlayer.mlp.gate_proj.weight": rand(INTER, HIDDEN),
        "midlayer.mlp.up_proj.weight": rand(INTER, HIDDEN),
        "midlayer.mlp.down_proj.weight": rand(HIDDEN, INTER),
        "norm.weight": 1 + rand(HIDDEN, scale=0.1),
        "lm_head.weight": rand(DRAFT_VOCAB, HIDDEN),
        "d2t": draft_ids - torch.arange(DRAFT_VOCAB),
        "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, draft_ids, True),
    }
    shape = SimpleNamespace(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=HEADS,
                            num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5, rope_theta=10000.0,
                            max_position_embeddings=1024, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB,
                            feature_layers=(1, 3, 5))
    return write_eagle3_head(tmp_path_factory.mktemp("head") / "head", tensors, head_config(shape))


@pytest.fixture(scope="module")
def embedding():
    return np.random.default_rng(1).standard_normal((VOCAB, HIDDEN)).astype(np.float32)


def drive(head, steps=3, rounds=4, first=30):
    """What the drafter does (speculative/eagle3.py): context rows, draft steps on the carried state, the drafts
    truncated away, then the verified rows; `first` rows at the start. Returns every call's logits and state, and
    the cached keys at the end [positions, kv_heads, d]."""
    rng = np.random.default_rng(2)
    cache, outputs = head.new_cache(), []
    new = first
    for _ in range(rounds):
        tokens = rng.integers(0, VOCAB, new).tolist()
        logits, state = head.context_rows(cache, tokens, rng.standard_normal((new, 3 * HIDDEN)).astype(np.float32))
        outputs.append((logits, np.asarray(state).reshape(-1)))
        kept = len(cache)
        for token in rng.integers(0, VOCAB, steps).tolist():
            logits, state = head.draft_step(cache, token, state)
            outputs.append((logits, np.asarray(state).reshape(-1)))
        cache.truncate(kept)
        new = int(rng.integers(1, steps + 2))
    if hasattr(cache, "cached"):
        keys = cache.cached()[0]
    else:
        keys = cache.keys[:, : len(cache)].transpose(0, 1).numpy()
    return outputs, keys


def assert_close(reference, other, tolerance):
    (ref_out, ref_keys), (out, keys) = reference, other
    assert len(ref_out) == len(out)
    for (ref_logits, ref_state), (logits, state) in zip(ref_out, out):
        assert logits.shape == ref_logits.shape == (DRAFT_VOCAB,)
        assert np.abs(logits - ref_logits).max() <= tolerance * np.abs(ref_logits).max()
        assert np.abs(state - ref_state).max() <= tolerance * np.abs(ref_state).max()
    assert keys.shape == ref_keys.shape
    assert np.abs(keys - ref_keys).max() <= tolerance * np.abs(ref_keys).max()


def test_the_graph_computes_what_the_torch_head_computes(head_folder, embedding):
    torch_head, onnx_head = (open_head(head_folder, embedding, dtype=d) for d in ("float32", "ort-float32"))
    assert onnx_head.dtype == "ort-float32"
    for name in ("feature_layers", "feature_width", "draft_vocab_size", "target_vocab_size"):
        assert getattr(onnx_head, name) == getattr(torch_head, name)
    assert np.array_equal(onnx_head.token_ids, torch_head.token_ids)
    assert_close(drive(torch_head), drive(onnx_head), 1e-4)
    # past the cache's first capacity (256 positions): it grows and keeps what it held
    assert_close(drive(torch_head, first=250, rounds=6), drive(onnx_head, first=250, rounds=6), 1e-4)


def test_int8_matrices_stay_close(head_folder, embedding):
    """MatMulNBits at 8 bits (blocks of 64; activations quantized per block): near fp32's logits. The bound is loose
    (15% of the largest value; measured 5% on the state here) because these random weights, unlike a trained head's,
    carry the rounding of six chained products at full size; the graph itself is checked in fp32 above."""
    reference, int8 = (open_head(head_folder, embedding, dtype=d) for d in ("float32", "ort-int8"))
    expected, got = drive(reference), drive(int8)
    assert_close(expected, got, 0.15)
    assert any(np.abs(a[0] - b[0]).max() > 1e-4 for a, b in zip(expected[0], got[0]))  # quantized, not fp32


def test_a_wrong_rotary_base_fails_the_comparison(head_folder, embedding, monkeypatch):
    """The comparison sees positions: a graph with another RoPE base differs from the torch head."""
    original = eagle3_onnx.build_graph
    monkeypatch.setattr(eagle3_onnx, "build_graph", lambda tensors, **kw: original(tensors, **{**kw, "rope_theta": 500.0}))
    reference, planted = open_head(head_folder, embedding, dtype="float32"), open_head(head_folder, embedding, dtype="ort-float32")
    with pytest.raises(AssertionError):
        assert_close(drive(reference), drive(planted), 1e-4)


def test_an_unknown_runtime_is_refused(head_folder, embedding):
    with pytest.raises(eagle3_onnx.EngineError, match="ort-float32, ort-int8, not ort-int4"):
        open_head(head_folder, embedding, dtype="ort-int4")


def test_the_manifest_takes_every_head_runtime():
    """The manifest's head_dtype field lists exactly the runtimes fastest_head_dtype can choose."""
    import typing

    from specpipe.drafts.eagle3 import Eagle3Draft
    from specpipe.engines.eagle3_head import HEAD_DTYPES

    annotation = Eagle3Draft.model_fields["head_dtype"].annotation  # Optional[Literal[...]]
    literal = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    assert set(typing.get_args(literal)) == set(HEAD_DTYPES)
