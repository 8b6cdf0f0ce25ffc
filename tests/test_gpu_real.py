"""The TensorRT backend for real: engine build, engine vs ONNX Runtime, greedy equivalence, the gate.

gpu-marked: skipped where CUDA is not available (tests/conftest.py), and each test also needs the
tensorrt package. Nothing here has run in the session that wrote it (no GPU there); the plans these
engines follow are tested without a GPU in tests/test_gpu_plan.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

MAX_SEQ_LEN = 256
MAX_INPUT_LEN = 64
MAX_DRAFT_LEN = 5


def _tensorrt():
    return pytest.importorskip("tensorrt", reason="needs the tensorrt package")


def _build(checkpoint: Path, work: Path) -> tuple[Path, Path]:
    """ONNX export -> (ONNX Runtime folder, TensorRT folder), fp32, so the two can be compared closely."""
    from specpipe.checkpoint.facts import shape_from_config
    from specpipe.engines.onnxruntime import write_engine_meta
    from specpipe.engines.tensorrt_build import build_engine, optimization_profiles, write_tensorrt_meta
    from specpipe.export.onnx import export_onnx

    shape = shape_from_config(json.loads((checkpoint / "config.json").read_text()), spec=str(checkpoint))
    ort_dir = export_onnx(checkpoint, work / "onnx")
    write_engine_meta(
        ort_dir, vocab_size=shape.vocab, num_layers=shape.layers, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        max_seq_len=MAX_SEQ_LEN, quant="none",
    )  # fmt: skip
    profiles = optimization_profiles(shape, max_seq_len=MAX_SEQ_LEN, max_input_len=MAX_INPUT_LEN, max_draft_len=MAX_DRAFT_LEN)
    trt_dir = work / "trt"
    build_engine(ort_dir / "model.onnx", trt_dir, profiles, workspace_gb=1.0)
    write_tensorrt_meta(trt_dir, shape, profiles, max_seq_len=MAX_SEQ_LEN, max_draft_len=MAX_DRAFT_LEN, precision="float32", quant="none")
    return ort_dir, trt_dir


@pytest.fixture(scope="module")
def built_pair(tiny_target, tiny_draft, tmp_path_factory):
    _tensorrt()
    root = tmp_path_factory.mktemp("trt")
    return {"target": _build(tiny_target, root / "target"), "draft": _build(tiny_draft, root / "draft")}


def test_engine_build_writes_plan_and_meta(built_pair):
    _, trt_dir = built_pair["target"]
    meta = json.loads((trt_dir / "engine.json").read_text())
    assert (trt_dir / "model.plan").stat().st_size > 0
    assert meta["backend"] == "tensorrt" and [p["name"] for p in meta["profiles"]] == ["prefill", "decode", "verify"]


def test_tensorrt_matches_onnxruntime_through_cache_and_rollback(built_pair):
    from specpipe.engines import load_engine

    ort_dir, trt_dir = built_pair["target"]
    ort, trt = load_engine(ort_dir), load_engine(trt_dir)
    assert type(trt).__name__ == "TensorRTEngine"
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ort.vocab_size, size=40).tolist()
    a, b = ort.new_sequence(), trt.new_sequence()
    # prefill 12 (prefill profile), decode 1 (decode), verify 5 (verify), roll back 3, re-verify, long catch-up
    for chunk in (ids[:12], ids[12:13], ids[13:18]):
        np.testing.assert_allclose(b.append(chunk), a.append(chunk), atol=2e-2, rtol=0)  # TF32 GEMMs allowed
    a.truncate(15), b.truncate(15)
    np.testing.assert_allclose(b.append(ids[15:20]), a.append(ids[15:20]), atol=2e-2, rtol=0)
    long = rng.integers(0, ort.vocab_size, size=MAX_INPUT_LEN + 10).tolist()  # longer than the prefill profile
    a2, b2 = ort.new_sequence(), trt.new_sequence()
    np.testing.assert_allclose(b2.append(long), a2.append(long), atol=2e-2, rtol=0)
    assert b2.tokens == long


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_equals_target_only(built_pair, k):
    """TensorRTEngine under the unchanged speculative decoder: drafts never change greedy output."""
    from specpipe.contract.generation import GenerationConfig
    from specpipe.engines import load_engine
    from specpipe.speculative.decoder import SpeculativeDecoder
    from specpipe.speculative.drafters import ModelDrafter
    from specpipe.speculative.stats import SpecStats

    target = load_engine(built_pair["target"][1])
    draft = load_engine(built_pair["draft"][1])
    decoder = SpeculativeDecoder(target, ModelDrafter(draft, target.vocab_size))
    prompt = list(range(5, 17))

    def run(speculative: bool) -> list[int]:
        cfg = GenerationConfig(max_new_tokens=32, num_draft_tokens=k, draft_length="fixed", speculative=speculative, stop_on_eos=False)
        return [t for step in decoder.decode(prompt, cfg, SpecStats()) for t in step]

    speculative, target_only = run(True), run(False)
    assert len(target_only) == 32 and speculative == target_only
    # and the TensorRT target agrees with the ONNX Runtime one on the same greedy run, up to numerics
    ort = load_engine(built_pair["target"][0])
    seq = ort.new_sequence()
    logits = seq.append(prompt + target_only[:-1])[len(prompt) - 1 :]
    top2 = np.sort(logits, axis=-1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 5e-2  # positions where TF32 rounding cannot flip the argmax
    assert np.array_equal(np.argmax(logits, -1)[decided], np.asarray(target_only)[decided])


def test_gate_greedy_check_passes_on_tensorrt_engines(tiny_target, tiny_draft, built_pair, tmp_path):
    """A CPU deployment whose manifest points at the TensorRT engines passes the gate's greedy check."""
    import shutil

    from specpipe.builder import build
    from specpipe.builder.config import BuildConfig
    from specpipe.deployment import load_deployment
    from specpipe.gate.config import GateConfig
    from specpipe.gate.greedy import check_greedy
    from specpipe.gate.subjects import InProcessSubject

    folder = build(BuildConfig(target=str(tiny_target), draft=str(tiny_draft), engines_dir=tmp_path, repo_dir=None))
    manifest = json.loads((folder / "manifest.json").read_text())
    for role in ("target", "draft"):
        shutil.copytree(built_pair[role][1], folder / f"{role}_trt")
        manifest[role]["engine"].update(path=f"{role}_trt", backend="tensorrt")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    deployment = load_deployment(folder)
    assert type(deployment.target).__name__ == "TensorRTEngine"
    result = check_greedy(InProcessSubject(deployment), GateConfig(), lambda n: None)
    assert result.status == "passed", result.failures
