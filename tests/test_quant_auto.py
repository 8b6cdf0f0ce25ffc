"""Weight-only targets made by onnxruntime-genai's model builder, and `--quant auto` (fp32 and every candidate built,
measured for accuracy and timed at the server's batch sizes; builder/quant_choice.py's rule picks)."""

import dataclasses
import json
from types import SimpleNamespace

import onnx
import pytest
from pydantic import ValidationError

from specpipe.builder.config import BuildConfig
from specpipe.contract.quant import AUTO_QUANT_CANDIDATES, QuantConfig
from specpipe.contract.quant import AccuracyReport
from tests.test_cli_core import assert_one_line_error, run_cli


@pytest.fixture(scope="module")
def genai_fp32(tiny_target, tmp_path_factory):
    """tiny_target as the builder's unquantized shared-KV engine, with the engine.json build writes."""
    from specpipe.checkpoint import inspect_checkpoint
    from specpipe.engines.onnxruntime import write_engine_meta
    from specpipe.engines.shared_kv import KV_LAYOUT
    from specpipe.export.ortgenai_builder import run_model_builder

    work = tmp_path_factory.mktemp("genai")
    out = run_model_builder(tiny_target, work / "fp32", "fp32", work / "cache")
    info = inspect_checkpoint(tiny_target)
    write_engine_meta(out, vocab_size=info.vocab_size, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads,
                      head_dim=info.head_dim, max_seq_len=256, quant="none", kv_layout=KV_LAYOUT)
    return out


def _matmul_nbits(folder):
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    return {node.name: {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            for node in graph.node if node.op_type == "MatMulNBits"}


def test_builder_argv_carries_the_recipes_extra_options(tmp_path):
    from specpipe.export.ortgenai_builder import builder_argv
    from specpipe.quantize.weight_only import BUILDER_RECIPES

    recipe = BUILDER_RECIPES["int4-wo"]
    argv = builder_argv(tmp_path / "ckpt", tmp_path / "out", recipe.precision, tmp_path / "cache", recipe.options(64))
    assert argv[argv.index("-p") + 1] == "int4"
    pairs = argv[argv.index("--extra_options") + 1:]
    assert "block_size=64" in pairs and "accuracy_level=4" in pairs
    assert all(f"{key}={value}" in pairs for key, value in recipe.extra_options)


def test_builder_quantizes_with_the_recipe(genai_fp32, tiny_target, tiny_tokenizer, tmp_path):
    """The options reach the builder: its MatMulNBits carry the group size asked for (not its default 32) and
    the recipe's int8 lm_head (not the int4 body's bits); the manifest block records the settings."""
    from specpipe.quantize import quantize_engine

    block = quantize_engine(genai_fp32, tmp_path / "q", QuantConfig(mode="int4-wo", group_size=16, accept_accuracy_loss=True),
                            tiny_tokenizer, model_name="target", threads=1, checkpoint=tiny_target)
    nodes = _matmul_nbits(tmp_path / "q")
    assert nodes and {attrs["block_size"] for attrs in nodes.values()} == {16}
    assert {attrs["accuracy_level"] for attrs in nodes.values()} == {4}
    assert [attrs["bits"] for name, attrs in nodes.items() if name.startswith("/lm_head/")] == [8]
    assert any(attrs["bits"] == 4 for attrs in nodes.values())
    assert block["recipe"]["quantizer"] == "onnxruntime-genai model builder"
    assert block["recipe"]["extra_options"]["block_size"] == "16" and block["recipe"]["precision"] == "int4"
    assert json.loads((tmp_path / "q" / "engine.json").read_text())["quant"] == "int4-wo"
    assert block["accuracy"]["num_positions"] > 0


def _planted_accuracy(over_budget: set[str]):
    """A stand-in for measure_accuracy: each engine in `over_budget` (by its engine.json quant) far off, others exact."""
    def measure(ref_dir, quant_dir, token_batches, *, threads=1):
        mode = json.loads((quant_dir / "engine.json").read_text())["quant"]
        bad = mode in over_budget
        return AccuracyReport(mode=mode, num_sequences=1, num_positions=10, ppl_ref=10.0, ppl_quant=20.0 if bad else 10.0,
                              ppl_rel_change=1.0 if bad else 0.0, top1_agreement=0.5 if bad else 1.0,
                              mean_kl=0.9 if bad else 0.0, max_kl=1.0)
    return measure


# Batched step times (rows -> ms) shaped like the ones measured on SmolLM2-135M (docs/quantization.md):
# Zen 4 with VNNI, int8-wo faster alone and batched; AVX2 without VNNI, int8-wo faster alone, slower at 16 rows.
VNNI = {"none": {1: 26.8, 2: 27.5, 4: 29.0, 8: 31.0, 16: 36.4}, "int8-wo": {1: 10.5, 2: 12.0, 4: 15.0, 8: 20.0, 16: 27.7},
        "int4-wo": {1: 7.6, 2: 9.0, 4: 12.0, 8: 16.0, 16: 22.0}}
AVX2 = {"none": {1: 21.0, 2: 23.0, 4: 26.0, 8: 32.0, 16: 43.0}, "int8-wo": {1: 10.0, 2: 13.0, 4: 20.0, 8: 30.0, 16: 51.0},
        "int4-wo": {1: 7.5, 2: 10.0, 4: 17.0, 8: 28.0, 16: 50.0}}


def _candidates(costs: dict, over_budget=()):
    from specpipe.contract.manifest import QuantCandidate

    return [QuantCandidate(mode=mode, within_budget=mode not in over_budget, seconds=1.0, decode_ms=ms,
                           violations=[{"metric": "top-1 agreement", "value": 0.7, "limit": 0.9}] if mode in over_budget else [])
            for mode, ms in costs.items()]


def test_choice_with_vnni_costs_is_int8_for_a_server_and_alone():
    from specpipe.builder.quant_choice import choose

    for rows in (16, 1):
        mode, reason = choose(_candidates(VNNI, over_budget={"int4-wo"}), rows)
        assert mode == "int8-wo", reason
        assert "over the accuracy budget: int4-wo" in reason and "faster for one stream" not in reason


def test_choice_where_int8_batches_worse_is_fp32_for_a_batching_server_and_int8_alone():
    from specpipe.builder.quant_choice import choose

    mode, reason = choose(_candidates(AVX2, over_budget={"int4-wo"}), 16)
    assert mode == "none" and reason.startswith("fp32") and "16 requests" in reason
    # what the full load cost a lone user is said: int8-wo 100 against 47.6 tok/s alone, 313.7 against 372.1 at 16
    assert "int8-wo is faster for one stream (100.0 tok/s, 2.10x) and 0.84x at full load" in reason
    mode, reason = choose(_candidates(AVX2, over_budget={"int4-wo"}), 1)
    assert mode == "int8-wo" and "one request at a time" in reason
    mode, _ = choose(_candidates(AVX2, over_budget={"int4-wo"}), 4)  # 4 / 26 ms against 4 / 20 ms
    assert mode == "int8-wo"


def test_a_precision_over_budget_is_never_chosen_even_when_fastest():
    from specpipe.builder.quant_choice import choose

    assert choose(_candidates(VNNI), 16)[0] == "int4-wo"  # the same costs, in budget: int4-wo is fastest
    assert choose(_candidates(VNNI, over_budget={"int4-wo"}), 16)[0] == "int8-wo"
    assert choose(_candidates(VNNI, over_budget={"int4-wo", "int8-wo"}), 16)[0] == "none"


def test_a_near_tie_at_full_load_goes_to_the_faster_one_stream():
    """int8-wo 3% slower than fp32 at 16 rows (within LOAD_TIE) and twice as fast alone: int8-wo; 10% slower: fp32."""
    from specpipe.builder.quant_choice import LOAD_TIE, choose

    near = {"none": {1: 20.0, 16: 40.0}, "int8-wo": {1: 10.0, 16: 40.0 / (1 - 0.6 * LOAD_TIE)}}
    mode, reason = choose(_candidates(near), 16)
    assert mode == "int8-wo" and "fp32 within 5% at full load, slower alone" in reason
    far = {"none": {1: 20.0, 16: 40.0}, "int8-wo": {1: 10.0, 16: 40.0 / (1 - 2 * LOAD_TIE)}}
    assert choose(_candidates(far), 16)[0] == "none"


def test_goodput_reads_sizes_between_those_timed_as_the_planner_does():
    from specpipe.contract.costs import BatchCosts

    candidate = _candidates({"none": {1: 10.0, 2: 12.0, 4: 16.0}})[0]
    assert candidate.tokens_per_s(4) == pytest.approx(4 * 1e3 / 16.0)
    assert candidate.tokens_per_s(3) == pytest.approx(3 * 1e3 / BatchCosts({1: 10.0, 2: 12.0, 4: 16.0}).decode(3))


def _planted_speeds(costs: dict):
    """A stand-in for measure_precisions: `costs` by mode, for the rows asked (the sizes the build times)."""
    from specpipe.builder.measure import batch_sizes
    from specpipe.contract.costs import BatchCosts

    def measure(folders, min_rows, max_rows, threads, **options):
        assert set(folders) == {"none", *AUTO_QUANT_CANDIDATES} and all(f.is_dir() for f in folders.values())
        return {mode: {n: BatchCosts(costs[mode]).decode(n) for n in batch_sizes(max_rows)} for mode in folders}
    return measure


def test_auto_build_deploys_the_measured_choice_and_records_every_measurement(monkeypatch, tiny_target, tmp_path):
    """int4-wo planted over budget and fastest, VNNI-like costs: the build deploys int8-wo, keeps fp32 beside it,
    removes int4-wo, and the manifest records every precision's accuracy, step times and the reason."""
    from specpipe.builder import build
    from specpipe.drafts import read_manifest

    monkeypatch.setattr("specpipe.quantize.accuracy.measure_accuracy", _planted_accuracy({"int4-wo"}))
    monkeypatch.setattr("specpipe.builder.cpu.measure_precisions", _planted_speeds(VNNI))
    folder = build(BuildConfig(target=str(tiny_target), draft="none", name="auto", engines_dir=tmp_path, repo_dir=None,
                               quant=QuantConfig(mode="auto"), backend={"kind": "onnxruntime", "max_batch_size": 8}))
    manifest = json.loads((folder / "manifest.json").read_text())
    target = manifest["target"]
    assert target["engine"]["quant"] == "int8-wo" and target["quant"]["mode"] == "int8-wo"
    assert manifest["build"]["quant"]["mode"] == "auto"
    quant = read_manifest(folder).target.quant
    assert [c.mode for c in quant.candidates] == ["none", "int8-wo", "int4-wo"]
    assert [c.within_budget for c in quant.candidates] == [True, True, False]
    assert quant.candidates[2].violations and quant.candidates[2].accuracy.top1_agreement == 0.5
    assert quant.candidates[0].accuracy is None
    assert [sorted(c.decode_ms) for c in quant.candidates] == [[1, 2, 4, 8]] * 3
    assert quant.candidates[1].decode_ms[8] == VNNI["int8-wo"][8]
    assert quant.load_rows == 8 and quant.reason.startswith("int8-wo decodes the most tokens/s")
    assert json.loads((folder / "target" / "engine.json").read_text())["quant"] == "int8-wo"
    assert (folder / quant.reference_path / "model.onnx").is_file()
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("target")) == ["target", "target-fp32"]
    assert target["verify_consistency"]["positions"] > 0


def test_auto_keeps_fp32_where_quantized_targets_batch_worse(monkeypatch, genai_fp32, tiny_tokenizer, tmp_path):
    """Every quantized target in budget, AVX2-like costs, a 16-request server: fp32 takes the target's place and
    the quantized engines are removed; the record says why."""
    import shutil

    from specpipe.builder.cpu import _auto_quant

    reference = tmp_path / "target-fp32"
    shutil.copytree(genai_fp32, reference)
    monkeypatch.setattr("specpipe.quantize.accuracy.measure_accuracy", _planted_accuracy(set()))
    monkeypatch.setattr("specpipe.builder.cpu.measure_precisions", _planted_speeds(AVX2))
    said = []
    cfg = BuildConfig(target="x", draft="none", backend={"kind": "onnxruntime", "max_batch_size": 16, "threads": 1})
    record, consistency, min_rows = _auto_quant(reference, tmp_path / "target", QuantConfig(mode="auto"), tiny_tokenizer,
                                                None, cfg, said.append, "target", {})
    assert record.mode == "none" and record.reference_path is None and not reference.exists()
    assert json.loads((tmp_path / "target" / "engine.json").read_text())["quant"] == "none"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
    assert [(c.mode, c.within_budget) for c in record.candidates] == [("none", True), ("int8-wo", True), ("int4-wo", True)]
    assert record.reason.startswith("fp32") and record.load_rows == 16
    assert consistency.positions > 0 and min_rows >= 1
    assert any(line.startswith("--quant auto: chose fp32") for line in said)


@pytest.mark.timing
def test_the_builders_candidates_are_quantized_side_by_side_and_each_judged_when_ready(monkeypatch, genai_fp32,
                                                                                         tiny_tokenizer, tmp_path):
    """Where onnxruntime-genai's model builder quantizes (a process of its own, one core each), the candidates are made
    at once: int8-wo's quantizer waits here until int4-wo's has started, and int4-wo's until int8-wo's accuracy has
    been measured. One at a time, or all made before any is judged, times out on an event below."""
    import shutil
    import threading

    from specpipe.builder.cpu import _auto_quant
    from specpipe.quantize.pipeline import QuantResult

    started, judged = {m: threading.Event() for m in AUTO_QUANT_CANDIDATES}, {m: threading.Event() for m in AUTO_QUANT_CANDIDATES}
    waits = {"int8-wo": started["int4-wo"], "int4-wo": judged["int8-wo"]}

    def quantize_with_builder(checkpoint, src_dir, dst_dir, cfg, *, cancel=None):
        started[cfg.mode].set()
        assert waits[cfg.mode].wait(timeout=60), f"{cfg.mode}'s quantizer waited for the other candidate in vain"
        shutil.copytree(src_dir, dst_dir)
        meta = json.loads((dst_dir / "engine.json").read_text())
        (dst_dir / "engine.json").write_text(json.dumps({**meta, "quant": cfg.mode}))
        return QuantResult(mode=cfg.mode, quantized_layers=0, untied_weights=[], group_size=cfg.block_size,
                           calib_sequences=0, calib_tokens=0, smooth_quant=False, src_bytes=1, dst_bytes=1, seconds=0.0)

    measure = _planted_accuracy({"int4-wo"})

    def measure_accuracy(ref_dir, quant_dir, token_batches, *, threads=1):
        report = measure(ref_dir, quant_dir, token_batches, threads=threads)
        judged[report.mode].set()
        return report

    reference = tmp_path / "target-fp32"
    shutil.copytree(genai_fp32, reference)
    monkeypatch.setattr("specpipe.quantize.pipeline.quantize_with_builder", quantize_with_builder)
    monkeypatch.setattr("specpipe.quantize.accuracy.measure_accuracy", measure_accuracy)
    monkeypatch.setattr("specpipe.builder.cpu.measure_precisions", _planted_speeds(VNNI))
    monkeypatch.setattr("specpipe.builder.cpu.usable_cpus", lambda: 2)
    monkeypatch.setattr("specpipe.builder.cpu.available_memory_bytes", lambda: 64 << 30)
    said = []
    cfg = BuildConfig(target="x", draft="none", backend={"kind": "onnxruntime", "max_batch_size": 16, "threads": 1})
    record, _, _ = _auto_quant(reference, tmp_path / "target", QuantConfig(mode="auto"), tiny_tokenizer,
                               tmp_path / "checkpoint", cfg, said.append, "target", {})
    assert record.mode == "int8-wo"
    assert [(c.mode, c.within_budget) for c in record.candidates] == [("none", True), ("int8-wo", True), ("int4-wo", False)]
    assert any("int8-wo, int4-wo side by side" in line for line in said)


@pytest.mark.timing
def test_a_failing_candidate_stops_the_other_builder_and_fails_the_build_at_once(monkeypatch, genai_fp32, tiny_tokenizer,
                                                                                tmp_path):
    """int8-wo's builder fails while int4-wo's runs: the build fails with int8-wo's reason and int4-wo's builder is
    told to stop (here: it waits for that, 60 s at most). Before, the failure waited for the other builder to finish
    (minutes on a large target); waiting still, or never stopping it, leaves int4-wo's wait unanswered below."""
    import shutil
    import threading

    from specpipe.builder.cpu import _auto_quant
    from specpipe.errors import ExportError

    running, stopped = threading.Event(), {}

    def quantize_with_builder(checkpoint, src_dir, dst_dir, cfg, *, cancel=None):
        if cfg.mode == "int8-wo":
            assert running.wait(timeout=60), "int4-wo's builder never started"
            raise ExportError("onnxruntime-genai's model builder failed on x (int8): planted")
        running.set()
        stopped[cfg.mode] = cancel is not None and cancel.wait(timeout=60)
        raise ExportError("onnxruntime-genai's model builder was stopped on x (int4)")

    reference = tmp_path / "target-fp32"
    shutil.copytree(genai_fp32, reference)
    monkeypatch.setattr("specpipe.quantize.pipeline.quantize_with_builder", quantize_with_builder)
    monkeypatch.setattr("specpipe.builder.cpu.usable_cpus", lambda: 2)
    monkeypatch.setattr("specpipe.builder.cpu.available_memory_bytes", lambda: 64 << 30)
    cfg = BuildConfig(target="x", draft="none", backend={"kind": "onnxruntime", "max_batch_size": 16, "threads": 1})
    with pytest.raises(ExportError, match="planted"):
        _auto_quant(reference, tmp_path / "target", QuantConfig(mode="auto"), tiny_tokenizer, tmp_path / "checkpoint",
                    cfg, lambda line: None, "target", {})
    assert stopped == {"int4-wo": True}


@pytest.mark.parametrize("how", ["cancel", "timeout"])
def test_a_builder_process_is_killed_when_stopped_or_past_its_time(how):
    """run_until's two ways out of a process that would run a minute: its cancel event, and its deadline."""
    import sys
    import threading

    from specpipe.errors import ExportError
    from specpipe.export.ortgenai_builder import run_until

    cancel = threading.Event()
    if how == "cancel":
        threading.Timer(0.2, cancel.set).start()
    with pytest.raises(ExportError) as err:  # a process left to finish returns normally: no error
        run_until([sys.executable, "-c", "import time; time.sleep(60)"], 0.3 if how == "timeout" else 600, cancel,
                  "the stand-in", "nothing")
    assert ("was stopped" if how == "cancel" else "ran past") in str(err.value)


def test_the_builders_quantizers_run_one_a_core_as_many_as_memory_holds():
    from specpipe.builder.cpu import BUILDER_PEAK_PER_WEIGHT_BYTE, quantizers_side_by_side

    weights = 538_090_408  # SmolLM2-135M in fp32
    peak = BUILDER_PEAK_PER_WEIGHT_BYTE * weights
    assert quantizers_side_by_side(2, weights, 2, 24 << 30) == 2
    assert quantizers_side_by_side(2, weights, 1, 24 << 30) == 1  # one core: one at a time
    assert quantizers_side_by_side(2, weights, 16, 24 << 30) == 2  # never more than the candidates
    assert quantizers_side_by_side(2, weights, 2, int(1.5 * peak)) == 1  # room for one builder's peak, not two
    assert quantizers_side_by_side(2, weights, 2, int(2 * peak)) == 2
    assert quantizers_side_by_side(2, weights, None, 24 << 30) == 1 and quantizers_side_by_side(2, weights, 2, None) == 1


def test_available_memory_is_read_from_meminfo(tmp_path):
    from specpipe.machine import available_memory_bytes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    assert available_memory_bytes(str(meminfo)) == 20_000_000 * 1024
    meminfo.write_text("MemTotal:       24576000 kB\n")
    assert available_memory_bytes(str(meminfo)) is None
    assert available_memory_bytes(str(tmp_path / "absent")) is None


def test_measure_precisions_times_every_engine_at_every_size(genai_fp32):
    from specpipe.builder.measure import measure_precisions

    ms = measure_precisions({"none": genai_fp32, "int8-wo": genai_fp32}, {"none": 1, "int8-wo": 2}, 4, 1, repeats=2)
    assert list(ms) == ["none", "int8-wo"]
    assert all(sorted(by_rows) == [1, 2, 4] and all(v > 0 for v in by_rows.values()) for by_rows in ms.values())


def test_batch_steps_take_turns_call_by_call():
    """The engines are timed A B A B ..., not A A B B: load that changes during the measurement falls on both."""
    from specpipe.engines.timing import batch_steps_ms

    calls = []

    class Batch:
        def __init__(self, name):
            self.name = name

        def new_sequence(self):
            return Sequence()

        def decode(self, sequences, tokens):
            calls.append(self.name)

    class Sequence:
        def append(self, tokens):
            pass

        def truncate(self, length):
            pass

    class Engine:
        vocab_size = 100

        def __init__(self, name):
            self.name = name

        def new_batch(self, rows):
            return Batch(self.name)

    batch_steps_ms([Engine("a"), Engine("b")], 2, repeats=3)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # a warm-up call each, then turns


def test_a_manifest_from_before_timed_choices_reads(tmp_path):
    """A QuantRecord written by the first-within-budget rule (no step times, no reason) still reads and prints."""
    from specpipe.contract.manifest import QuantRecord

    old = {"mode": "int8-wo", "candidates": [
        {"mode": "int4-wo", "within_budget": False, "seconds": 47.0, "violations": [{"metric": "top-1 agreement", "value": 0.7, "limit": 0.9}]},
        {"mode": "int8-wo", "within_budget": True, "seconds": 21.0}]}
    record = QuantRecord.model_validate(old)
    assert record.load_rows is None and record.reason is None and record.candidates[1].decode_ms is None
    assert record.candidates[1].summary(16) == "int8-wo: within budget (21 s)"
    assert record.model_dump() == {**old, "candidates": [{**c, "violations": c.get("violations", [])} for c in old["candidates"]]}


def test_auto_is_the_targets_alone(tiny_target, capsys, tmp_path):
    with pytest.raises(ValidationError, match="--draft-quant auto"):
        BuildConfig(target=str(tiny_target), draft=str(tiny_target), draft_quant=QuantConfig(mode="auto"))
    code, _, err = run_cli(capsys, "build", "--target", str(tiny_target), "--draft", str(tiny_target), "--no-repo",
                           "--draft-quant", "auto", "--engines-dir", str(tmp_path))
    assert_one_line_error(code, err, "auto")


def test_quantize_engine_refuses_auto(genai_fp32, tiny_tokenizer, tmp_path):
    from specpipe.errors import UsageError
    from specpipe.quantize import quantize_engine

    with pytest.raises(UsageError, match="auto"):
        quantize_engine(genai_fp32, tmp_path / "q", QuantConfig(mode="auto"), tiny_tokenizer, model_name="target")


def test_candidate_summary_names_the_failed_metric():
    from specpipe.contract.manifest import QuantCandidate

    accuracy = dataclasses.asdict(AccuracyReport(mode="int4-wo", num_sequences=1, num_positions=10, ppl_ref=10.0,
                                                 ppl_quant=10.8, ppl_rel_change=0.08, top1_agreement=0.7, mean_kl=0.47,
                                                 max_kl=7.0))
    line = QuantCandidate(mode="int4-wo", accuracy=accuracy, within_budget=False, seconds=12.0,
                          violations=[{"metric": "top-1 agreement", "value": 0.7, "limit": 0.9}]).summary()
    assert "+8.0%" in line and "0.700" in line and "over budget (top-1 agreement 0.7 vs limit 0.9)" in line


def test_the_demo_builds_its_target_at_the_measured_precision(monkeypatch, tmp_path):
    """demo.py asks the build for --quant auto (not a constant precision) and prints the table that chose it."""
    from rich.console import Console

    from specpipe import demo
    from specpipe.contract.manifest import QuantRecord

    asked = {}

    def build(cfg, progress=None):
        asked["cfg"] = cfg
        raise RuntimeError("stop")

    monkeypatch.setattr("specpipe.builder.build", build)
    state = demo.Demo(Console(file=None, record=True), engines_dir=tmp_path, repo_dir=tmp_path / "repo")
    state.target, state.draft_path = SimpleNamespace(weights_sha256="x"), tmp_path
    with pytest.raises(RuntimeError, match="stop"):
        demo.build_engines(state)
    assert asked["cfg"].quant.mode == "auto"

    record = QuantRecord(mode="none", candidates=_candidates(AVX2, over_budget={"int4-wo"}), load_rows=16,
                         reason="fp32 decodes the most tokens/s")
    manifest = SimpleNamespace(target=SimpleNamespace(quant=record))
    demo._print_precisions(state, manifest)
    text = state.console.export_text()
    assert "* fp32" in text and "OVER" in text and "43.0" in text and "fp32 decodes the most tokens/s" in text


# --- Rows per call without a draft (builder/measure.py `rows_per_call`) ---

BATCH_PROMPTS = [[5, 17, 42, 99, 7], [1, 2, 3], [100, 200, 150, 7, 8, 9, 10], [9, 8, 7, 6]]


@pytest.fixture(scope="module")
def genai_int8(genai_fp32, tiny_target, tiny_tokenizer, tmp_path_factory):
    """tiny_target as the builder's int8-wo shared-KV engine (MatMulNBits with int8 activations, accuracy_level 4)."""
    from specpipe.quantize import quantize_engine

    out = tmp_path_factory.mktemp("int8") / "target"
    quantize_engine(genai_fp32, out, QuantConfig(mode="int8-wo", accept_accuracy_loss=True), tiny_tokenizer,
                    model_name="target", threads=1, checkpoint=tiny_target)
    return out


@pytest.mark.parametrize("mode", ["none", "int8-wo"])
def test_unpadded_lone_steps_score_like_batched_steps(genai_fp32, genai_int8, mode):
    """A request alone and the same request in a batched step take the same kernels when neither is padded: a
    batched step is one token per row, as a lone step is (the near-tie rule's tolerance bounds the difference)."""
    from specpipe.engines import load_engine
    from specpipe.engines.consistency import batch_consistency
    from specpipe.speculative.equivalence import near_tie_tolerance

    folder = {"none": genai_fp32, "int8-wo": genai_int8}[mode]
    result = batch_consistency(load_engine(folder, threads=1, min_rows=1), BATCH_PROMPTS, new_tokens=24)
    assert result.positions == 4 * 24 and result.argmax_flips == 0
    assert result.max_abs_logit_diff <= near_tie_tolerance(mode)


def test_rows_per_call_pads_only_a_target_that_verifies():
    from specpipe.builder.measure import rows_per_call
    from specpipe.contract.manifest import ConsistencyRecord
    record = ConsistencyRecord(max_abs_logit_diff=0.0, argmax_flips=0, positions=48, chunk=5, exact=True,
                               near_tie_tolerance=1e-3, unpadded_max_abs_logit_diff=1.4)
    none, ngram = SimpleNamespace(kind="none"), SimpleNamespace(kind="ngram")  # all rows_per_call reads of an entry
    assert rows_per_call(record, 2, ngram) == (record, 2)
    kept, rows = rows_per_call(record, 2, none)
    assert rows == 1 and not kept.verify_calls and kept.unpadded_max_abs_logit_diff == 1.4
    assert rows_per_call(record, 1, none) == (record, 1)


@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_only_a_build_that_drafts_pads_its_quantized_target(monkeypatch, tiny_target, tmp_path, draft):
    """The tiny target's kernels may score 1-token and verify rows alike here; the verify check answering "pad to 2
    rows" (as it does for SmolLM2 int8-wo) is planted. --draft none never runs a verify call, so its target runs 1
    row per call and the record says why; a build with a draft keeps the padding."""
    import specpipe.builder.cpu as cpu
    from specpipe.builder import build
    from specpipe.deployment import load_deployment
    from specpipe.drafts import read_manifest

    measured = cpu.measure_target_min_rows

    def pads(*args, **kwargs):
        record, _ = measured(*args, **kwargs)
        return record.model_copy(update={"unpadded_max_abs_logit_diff": 1.4}), 2

    monkeypatch.setattr(cpu, "measure_target_min_rows", pads)
    folder = build(BuildConfig(target=str(tiny_target), draft=draft, name="alone", engines_dir=tmp_path, repo_dir=None,
                               quant=QuantConfig(mode="int8-wo", accept_accuracy_loss=True)))
    target = read_manifest(folder).target
    assert target.verify_consistency.unpadded_max_abs_logit_diff == 1.4
    assert (target.min_rows_per_call, target.verify_consistency.verify_calls) == ((1, False) if draft == "none" else (2, True))
    assert load_deployment(folder, threads=1).target.min_rows == target.min_rows_per_call


def test_planted_batch_step_that_mixes_rows_up_fails_batch_consistency(genai_fp32, monkeypatch):
    """batch_consistency can fail: a batched step that hands each row its neighbour's logits is caught."""
    from specpipe.engines import load_engine
    from specpipe.engines.consistency import batch_consistency
    from specpipe.engines.shared_kv import KVBatch

    decode = KVBatch.decode
    monkeypatch.setattr(KVBatch, "decode", lambda self, rows, tokens, preempt=None: decode(self, rows, tokens, preempt)[::-1])
    result = batch_consistency(load_engine(genai_fp32, threads=1), BATCH_PROMPTS, new_tokens=8)
    assert result.max_abs_logit_diff > 1e-3


def test_a_head_drafting_for_a_target_built_without_a_draft_pads_it():
    """`--draft HEAD` on a --draft none build: verify calls run after all, so the target pads as measured."""
    from specpipe.contract.manifest import ConsistencyRecord
    from specpipe.deployment import target_rows_per_call
    from specpipe.engines.onnxruntime import TARGET_MIN_ROWS

    record = ConsistencyRecord(max_abs_logit_diff=0.0, argmax_flips=0, positions=48, chunk=5, exact=True,
                               unpadded_max_abs_logit_diff=1.4, verify_calls=False)
    unpadded = SimpleNamespace(verify_consistency=record, min_rows_per_call=1)
    assert target_rows_per_call(unpadded, verifies=False) == 1
    assert target_rows_per_call(unpadded, verifies=True) == TARGET_MIN_ROWS
    drafting = SimpleNamespace(verify_consistency=record.model_copy(update={"verify_calls": True}), min_rows_per_call=1)
    assert target_rows_per_call(drafting, verifies=True) == 1  # measured consistent unpadded: nothing to pad


def test_the_draft_choice_times_the_target_alone_unpadded_and_checks_output_on_the_padded_one(genai_int8, tiny_tokenizer,
                                                                                                monkeypatch):
    """A target that pads its 1-token steps for the candidates' verify calls runs unpadded when deployed without a
    draft (rows_per_call): "none" is timed on that engine, the candidates on the padded one, and each candidate's
    output is compared with the padded target alone (a reference row, not a candidate). A planted unpadded engine
    that answers other tokens shows in none's row only, never as a candidate that changed the output."""
    import specpipe.builder.measure as measure
    from specpipe.builder.config import DraftChoiceConfig
    from specpipe.builder.measure import Candidate, measure_candidates
    from specpipe.contract.costs import StepCosts
    from specpipe.engines import load_engine
    from specpipe.speculative.ngram import NgramDrafter

    padded = load_engine(genai_int8, threads=1, min_rows=2)
    alone = load_engine(genai_int8, threads=1, min_rows=1)
    built = []
    row = measure._row
    monkeypatch.setattr(measure, "_row", lambda candidate, target, *a, **k: built.append(
        (k.get("label") or candidate.spec, target)) or row(candidate, target, *a, **k))
    ngram = Candidate("ngram", "ngram", NgramDrafter(), StepCosts(0.0, 0.1), source="ngram")
    cfg = DraftChoiceConfig(choice_sets=["code"], choice_prompts=1, choice_tokens=12, warmup_prompts=0)
    records = measure_candidates(padded, [ngram], tiny_tokenizer, [], cfg, max_draft_len=4, alone=alone)
    assert [(label, engine is alone) for label, engine in built] == [
        ("none", True), (measure.PADDED_BASELINE, False), ("ngram", False)]
    assert [r.draft for r in records] == ["none", "ngram"]  # the padded run is a reference, not a candidate
    assert records[1].matches_target == records[1].prompts == 1

    def other_tokens(candidate, target, *a, **k):  # planted: the unpadded target alone answers other tokens
        spec_row = row(candidate, target, *a, **k)
        if target is alone:
            run = spec_row.run
            spec_row.run = lambda *args: dataclasses.replace(m := run(*args), token_ids=m.token_ids[::-1] + [0])
        return spec_row

    monkeypatch.setattr(measure, "_row", other_tokens)
    records = measure_candidates(padded, [ngram], tiny_tokenizer, [], cfg, max_draft_len=4, alone=alone)
    assert records[1].matches_target == 1  # still equal to the padded target alone


def test_the_draft_choice_predicts_against_the_target_alone_as_deployed(genai_int8, tiny_tokenizer, monkeypatch):
    """A candidate's step costs are in steps of the padded target it runs on, and the deployment it would replace
    runs unpadded: its predicted speedup is the cost model's times the padded target's rate over the unpadded one's,
    from the same run. The padded row is made to read half as fast here, so an unscaled prediction fails."""
    import specpipe.builder.measure as measure
    from specpipe.builder.config import DraftChoiceConfig
    from specpipe.builder.measure import Candidate, measure_candidates
    from specpipe.contract.costs import StepCosts
    from specpipe.drafts import kind_named
    from specpipe.engines import load_engine
    from specpipe.speculative.adaptive import predicted_speedup
    from specpipe.speculative.ngram import NgramDrafter

    real = measure.summarize
    monkeypatch.setattr(measure, "summarize", lambda label, *a, **k: {**real(label, *a, **k), "speedup": 0.5}
                        if label == measure.PADDED_BASELINE else real(label, *a, **k))
    padded = load_engine(genai_int8, threads=1, min_rows=2)
    alone = load_engine(genai_int8, threads=1, min_rows=1)
    costs = StepCosts(0.05, 0.1)
    engine_kind = Candidate("a-model-draft", "model", NgramDrafter(), costs, source="a-model-draft")  # has an engine
    cfg = DraftChoiceConfig(choice_sets=["code"], choice_prompts=1, choice_tokens=12, warmup_prompts=0)
    _, record = measure_candidates(padded, [engine_kind], tiny_tokenizer, [], cfg, max_draft_len=4, alone=alone)
    ceiling = kind_named("model").entry.policy(max_draft_len=4).adaptive_ceiling
    unscaled = predicted_speedup(record.acceptance_rate, costs, ceiling)
    assert unscaled > 0 and record.predicted_speedup == pytest.approx(0.5 * unscaled)
    # one engine for both (a target that does not pad): nothing to scale
    _, record = measure_candidates(alone, [engine_kind], tiny_tokenizer, [], cfg, max_draft_len=4)
    assert record.predicted_speedup == pytest.approx(predicted_speedup(record.acceptance_rate, costs, ceiling))


def test_bench_times_the_target_alone_unpadded_beside_the_padded_reference():
    """spec_rows: with `alone`, the target-only row runs on it and the deployment's own target-only run follows as
    PADDED_BASELINE; summarize counts matches_target against that reference and speedup against the baseline."""
    from specpipe.bench.harness import BASELINE, PADDED_BASELINE, Measurement, spec_rows, summarize

    own, unpadded = object(), object()
    rows = spec_rows(own, [1], True, alone=unpadded)
    assert [(r.label, r.generator) for r in rows] == [(BASELINE, unpadded), (PADDED_BASELINE, own), ("K=1", own),
                                                      ("adaptive", own)]
    assert [r.label for r in spec_rows(own, [1], False, alone=own)] == [BASELINE, "K=1"]

    def runs(ids, ms):
        return [Measurement("p", 4, ms, 1.0, token_ids=ids)]

    row = summarize("K=1", "speculative", 1, runs([1, 2, 3, 4], 50.0), runs([1, 2, 3, 5], 100.0), runs([1, 2, 3, 4], 110.0))
    assert (row["speedup"], row["matches_target"]) == (2.0, 1)
    assert summarize("K=1", "speculative", 1, runs([1, 2, 3, 4], 50.0), runs([1, 2, 3, 5], 100.0))["matches_target"] == 0
