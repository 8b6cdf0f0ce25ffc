"""What keeps a peer's own behaviour from ending or mislabelling the bench: llama.cpp run first in a child process
(a crash of its kernels is a signal, which no `except` catches), and OpenVINO's compute precision set for fp32 rows.
The fakes stand in for llama-cpp-python and OpenVINO GenAI where they are not installed (CI installs '.[dev]'); the
tests marked with the real package run where it is."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from specpipe.bench.peers import llamacpp, missing_note, openvino
from specpipe.bench.peers.common import PeerPair
from specpipe.errors import ExportError


@pytest.mark.parametrize("probe, expected", [
    ("import os, signal\nos.kill(os.getpid(), signal.SIGILL)", "SIGILL"),
    ("import sys\nprint('refused', file=sys.stderr)\nsys.exit(3)", "exit 3: refused"),
    ("pass", None),
])
def test_a_probe_child_that_dies_is_named_by_its_signal(monkeypatch, probe, expected):
    monkeypatch.setattr(llamacpp, "_PROBE", probe)
    assert llamacpp._died(Path("model.gguf"), 1, extra_buffers=True) == expected


@pytest.fixture
def probes(monkeypatch):
    """`_died` answered by a table: (extra_buffers) -> how the child ended; every probe asked is recorded."""
    asked: list[bool] = []
    table: dict[bool, object] = {}

    def died(gguf, threads, extra_buffers):
        asked.append(extra_buffers)
        return table[extra_buffers]

    monkeypatch.setattr(llamacpp, "_died", died)
    llamacpp.runnable.cache_clear()
    yield table, asked
    llamacpp.runnable.cache_clear()


def test_a_gguf_that_runs_keeps_llamas_extra_buffers(probes):
    table, asked = probes
    table[True] = None
    assert llamacpp.runnable(Path("/m/q8.gguf"), 2) == (True, None)
    assert llamacpp.runnable(Path("/m/q8.gguf"), 2) == (True, None)
    assert asked == [True]  # probed once per GGUF and thread count


def test_a_crash_on_the_repacked_buffers_runs_without_them_and_says_so(probes):
    table, asked = probes
    table[True], table[False] = "SIGILL", None
    extra, note = llamacpp.runnable(Path("/m/q8.gguf"), 2)
    assert extra is False and asked == [True, False]
    assert "SIGILL" in note and "use_extra_bufts off" in note and "m/q8.gguf" in note


def test_a_gguf_that_dies_either_way_is_an_export_error(probes):
    table, _ = probes
    table[True], table[False] = "SIGILL", "SIGSEGV"
    with pytest.raises(ExportError, match="SIGILL.*SIGSEGV"):
        llamacpp.runnable(Path("/m/q8.gguf"), 2)


def test_rows_open_every_llama_without_extra_buffers_after_such_a_crash(probes, monkeypatch, tmp_path):
    table, _ = probes
    table[True], table[False] = "SIGILL", None
    made: list[tuple[str, bool]] = []
    monkeypatch.setattr(llamacpp, "gguf_for", lambda checkpoint, gguf, precision: (tmp_path / "t.gguf", None))
    monkeypatch.setattr(llamacpp, "_llama", lambda path, extra_buffers=True, **kw: made.append((Path(path).name, extra_buffers)))
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = lambda **kw: object()
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)
    pair = PeerPair(target_dir=tmp_path, draft_dir=None, eos_token_ids=(2,), threads=2, draft_lengths=(2,), precision="int8")
    rows, notes = llamacpp.rows(pair)
    assert [r.label for r in rows] == ["llamacpp target-only", "llamacpp prompt-lookup"]
    assert made == [("t.gguf", False), ("t.gguf", False)]
    assert any("use_extra_bufts off" in n for n in notes)


def _fake_llama_cpp(monkeypatch):
    """A stand-in for llama-cpp-python 0.3.x's shape: `Llama.__init__` starts from the module function
    `llama_cpp.llama_cpp.llama_model_default_params()` (llama.py) and keeps it as `model_params`."""
    lib = types.ModuleType("llama_cpp.llama_cpp")
    lib.llama_model_default_params = lambda: types.SimpleNamespace(use_extra_bufts=True)

    class Llama:
        def __init__(self, model_path, **kwargs):
            self.model_params = sys.modules["llama_cpp.llama_cpp"].llama_model_default_params()

    package = types.ModuleType("llama_cpp")
    package.llama_cpp, package.Llama = lib, Llama
    monkeypatch.setitem(sys.modules, "llama_cpp", package)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", lib)
    return lib


def test_a_llama_without_extra_buffers_has_use_extra_bufts_off_and_the_default_comes_back(monkeypatch):
    lib = _fake_llama_cpp(monkeypatch)
    default = lib.llama_model_default_params
    assert llamacpp._llama("m.gguf", extra_buffers=False).model_params.use_extra_bufts is False
    assert lib.llama_model_default_params is default
    assert llamacpp._llama("m.gguf").model_params.use_extra_bufts is True


def test_openvino_fp32_rows_compute_in_f32_and_quantized_rows_say_what_they_compute_in(monkeypatch, tmp_path):
    made: list[dict] = []
    genai = types.ModuleType("openvino_genai")

    class LLMPipeline:
        def __init__(self, model, device, **props):
            made.append({k: v for k, v in props.items() if k.isupper()})

    genai.LLMPipeline = LLMPipeline
    monkeypatch.setitem(sys.modules, "openvino_genai", genai)
    monkeypatch.setattr(openvino, "export", lambda checkpoint, precision: tmp_path / precision)
    monkeypatch.setattr(openvino, "default_precision", lambda: "bf16")
    for precision, hint, note in (("fp32", "f32", None), ("int8", None, "int8 weights, activations in bf16")):
        made.clear()
        pair = PeerPair(target_dir=tmp_path, draft_dir=None, eos_token_ids=(2,), threads=2, draft_lengths=(2,),
                        precision=precision)
        rows, notes = openvino.rows(pair)
        assert len(made) == len(rows) == 2  # target-only and prompt lookup
        assert all(props.get("INFERENCE_PRECISION_HINT") == hint and props["INFERENCE_NUM_THREADS"] == 2
                   for props in made)
        assert (notes[0].startswith(note) if note else notes == [])


def test_the_real_openvino_runs_f32_when_asked():
    note = missing_note("openvino")
    if note:
        pytest.skip(note)
    import openvino as ov

    core = ov.Core()
    core.set_property("CPU", openvino.properties("fp32", 1))
    assert core.get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name() == "f32"
