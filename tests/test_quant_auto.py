"""Weight-only targets made by onnxruntime-genai's model builder, and `--quant auto` (the first candidate within
the accuracy budget, fastest first; the unquantized engine when none is)."""

import dataclasses
import json

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


def test_auto_builds_keep_the_first_candidate_within_budget(monkeypatch, tiny_target, tmp_path):
    """int4-wo planted over budget, int8-wo within: the build deploys int8-wo and records both."""
    from specpipe.builder import build

    assert AUTO_QUANT_CANDIDATES[:2] == ("int4-wo", "int8-wo")
    monkeypatch.setattr("specpipe.quantize.accuracy.measure_accuracy", _planted_accuracy({"int4-wo"}))
    folder = build(BuildConfig(target=str(tiny_target), draft="none", name="auto", engines_dir=tmp_path, repo_dir=None,
                               quant=QuantConfig(mode="auto")))
    manifest = json.loads((folder / "manifest.json").read_text())
    target = manifest["target"]
    assert target["engine"]["quant"] == "int8-wo" and target["quant"]["mode"] == "int8-wo"
    assert manifest["build"]["quant"]["mode"] == "auto"
    candidates = target["quant"]["candidates"]
    assert [c["mode"] for c in candidates] == ["int4-wo", "int8-wo"]
    assert [c["within_budget"] for c in candidates] == [False, True]
    assert candidates[0]["violations"] and candidates[0]["accuracy"]["top1_agreement"] == 0.5
    assert json.loads((folder / "target" / "engine.json").read_text())["quant"] == "int8-wo"
    assert (folder / target["quant"]["reference_path"] / "model.onnx").is_file()


def test_auto_falls_back_to_the_unquantized_engine(monkeypatch, genai_fp32, tiny_tokenizer, tmp_path):
    """Every candidate planted over budget: the unquantized engine takes the target's place, and the record says so."""
    import shutil

    from specpipe.builder.cpu import _auto_quant

    reference = tmp_path / "target-fp32"
    shutil.copytree(genai_fp32, reference)
    monkeypatch.setattr("specpipe.quantize.accuracy.measure_accuracy", _planted_accuracy(set(AUTO_QUANT_CANDIDATES)))
    said = []
    record = _auto_quant(reference, tmp_path / "target", QuantConfig(mode="auto"), tiny_tokenizer, None, 1, said.append,
                         "target")
    assert record.mode == "none" and record.reference_path is None and not reference.exists()
    assert json.loads((tmp_path / "target" / "engine.json").read_text())["quant"] == "none"
    assert [(c.mode, c.within_budget) for c in record.candidates] == [(mode, False) for mode in AUTO_QUANT_CANDIDATES]
    assert any("keeping it unquantized" in line for line in said)


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
