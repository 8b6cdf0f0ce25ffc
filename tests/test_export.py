"""Export with optimum, optimize for ONNX Runtime, and the engine-vs-torch check (which must catch tampering)."""

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from transformers import AutoModelForCausalLM

from specpipe.engines.onnxruntime import OrtEngine, optimize_for_cpu, write_engine_meta
from specpipe.errors import EngineError, ExportMismatchError
from specpipe.export.onnx import check_export, export_onnx


@pytest.fixture(scope="module")
def exported(tiny_target, tmp_path_factory):
    raw = export_onnx(tiny_target, tmp_path_factory.mktemp("raw"))
    return raw / "model.onnx"


def make_engine(onnx_path, folder, vocab=320):
    optimize_for_cpu(onnx_path, folder)
    write_engine_meta(folder, vocab_size=vocab, max_seq_len=1024, ort_optimized=True)
    return OrtEngine(folder, threads=1)


def test_engine_matches_torch_on_prefill_and_kv_path(exported, tiny_target, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    diff = check_export(model, make_engine(exported, tmp_path / "e"), tolerance=1e-3, name="target")
    assert 0 <= diff < 1e-4


def test_rollback_then_recompute_gives_the_same_logits(exported, tmp_path):
    engine = make_engine(exported, tmp_path / "e")
    seq = engine.new_sequence()
    seq.append([1, 2, 3, 4])
    first = seq.append([10, 11, 12])
    seq.truncate(5)  # keep [1, 2, 3, 4, 10]
    again = seq.append([11, 12])
    np.testing.assert_allclose(first[1:], again, atol=1e-5)
    assert seq.tokens == [1, 2, 3, 4, 10, 11, 12]


def test_tampered_engine_is_caught(exported, tiny_target, tmp_path):
    model = onnx.load(exported)
    weights = max(model.graph.initializer, key=lambda t: np.prod(t.dims))
    tampered = numpy_helper.to_array(weights) * 1.05
    weights.CopyFrom(numpy_helper.from_array(tampered.astype(np.float32), weights.name))
    bad = tmp_path / "bad.onnx"
    onnx.save(model, bad)
    torch_model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    with pytest.raises(ExportMismatchError) as err:
        check_export(torch_model, make_engine(bad, tmp_path / "e"), tolerance=1e-3, name="target")
    assert err.value.max_abs_diff > 1e-3 and "max |logit diff|" in str(err.value)


def test_not_an_engine_folder(tmp_path):
    with pytest.raises(EngineError, match="engine.json"):
        OrtEngine(tmp_path)
