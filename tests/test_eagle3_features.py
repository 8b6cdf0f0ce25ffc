"""The target engine's EAGLE-3 features: the builder graph's extra output equals torch's residual stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specpipe.export.features import builder_layers, check_layers, default_layers, hf_hidden_state_index


def test_layer_conventions():
    assert default_layers(30) == (1, 14, 26)  # SmolLM2-135M: SGLang / SpecForge / TensorRT-LLM numbering
    assert builder_layers(default_layers(30)) == [2, 15, 27]  # vLLM's own default (2, N//2, N-3), same tensors
    assert [hf_hidden_state_index(i) for i in (1, 14, 26)] == [2, 15, 27]
    with pytest.raises(ValueError):
        default_layers(5)
    with pytest.raises(ValueError):
        check_layers([1, 29], 30)  # the last layer's output is normed before the head: not a feature


@pytest.fixture(scope="module")
def six_layer_target(tmp_path_factory, tiny_tokenizer):
    from specpipe.testing.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("six") / "ckpt", seed=3, num_layers=6, tokenizer=tiny_tokenizer)


@pytest.fixture(scope="module")
def feature_engine(six_layer_target, tmp_path_factory):
    from specpipe.checkpoint import inspect_checkpoint
    from specpipe.engines.onnxruntime import write_engine_meta
    from specpipe.engines.shared_kv import KV_LAYOUT, SharedKVEngine
    from specpipe.export.ortgenai_builder import run_model_builder

    work = tmp_path_factory.mktemp("features")
    layers = (1, 2, 4)  # default_layers(6) is (1, 2, 2): distinct layers test the order too
    out = run_model_builder(six_layer_target, work / "fp32", "fp32", work / "cache", feature_layers=layers)
    info = inspect_checkpoint(six_layer_target)
    write_engine_meta(out, vocab_size=info.vocab_size, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads,
                      head_dim=info.head_dim, max_seq_len=256, quant="none", kv_layout=KV_LAYOUT,
                      feature_layers=list(layers))
    return SharedKVEngine(out, threads=1)


def test_engine_features_equal_torch_hidden_states(feature_engine, six_layer_target):
    """Prefill, then two one-token decodes on top of the cache: at every position the graph's features are
    the residual stream after layers 1, 2 and 4 (transformers' hidden_states[2], [3], [5])."""
    from transformers import AutoModelForCausalLM

    engine = feature_engine
    assert engine.feature_layers == (1, 2, 4)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, engine.vocab_size, size=12).tolist()
    buffers = [np.zeros((1, engine.kv_heads, 64, engine.head_dim), dtype=engine.kv_dtype) for _ in engine.past_names]
    logits, features = engine.run_with_features(buffers, np.array([ids[:10]]), np.array([0]))
    steps = [engine.run_with_features(buffers, np.array([[token]]), np.array([10 + k])) for k, token in enumerate(ids[10:])]
    all_features = np.concatenate([features[0]] + [f[0] for _, f in steps])  # [12, 3H]
    all_logits = np.concatenate([logits[0]] + [lg[0] for lg, _ in steps])

    model = AutoModelForCausalLM.from_pretrained(six_layer_target).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    expected = torch.cat([out.hidden_states[hf_hidden_state_index(i)][0] for i in (1, 2, 4)], dim=-1).numpy()
    assert all_features.shape == expected.shape == (12, 3 * model.config.hidden_size)
    scale = np.abs(expected).max()
    assert np.abs(all_features - expected).max() <= 1e-4 * max(1.0, scale)
    assert np.abs(all_logits - out.logits[0].numpy()).max() <= 1e-3
    # The layers are told apart: one layer off would not match.
    wrong = torch.cat([out.hidden_states[i][0] for i in (1, 2, 4)], dim=-1).numpy()
    assert np.abs(all_features - wrong).max() > 100 * 1e-4 * max(1.0, scale)


def test_engine_without_features_refuses(tmp_path, tiny_target):
    from specpipe.checkpoint import inspect_checkpoint
    from specpipe.engines.onnxruntime import write_engine_meta
    from specpipe.engines.shared_kv import KV_LAYOUT, SharedKVEngine
    from specpipe.errors import EngineError
    from specpipe.export.ortgenai_builder import builder_argv, run_model_builder

    assert "--extra_options" not in builder_argv(tmp_path, tmp_path, "fp32", tmp_path)  # off by default
    out = run_model_builder(tiny_target, tmp_path / "fp32", "fp32", tmp_path / "cache")
    info = inspect_checkpoint(tiny_target)
    write_engine_meta(out, vocab_size=info.vocab_size, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads,
                      head_dim=info.head_dim, max_seq_len=256, quant="none", kv_layout=KV_LAYOUT)
    engine = SharedKVEngine(out, threads=1)
    assert engine.feature_layers == ()
    buffers = [np.zeros((1, engine.kv_heads, 16, engine.head_dim), dtype=engine.kv_dtype) for _ in engine.past_names]
    with pytest.raises(EngineError):
        engine.run_with_features(buffers, np.array([[5]]), np.array([0]))
