"""`specpipe build --quant/--draft-quant`: quantized engines with accuracy in the manifest, budget enforced."""

import json

import pytest

from specpipe.contract.generation import GenerationConfig
from specpipe.deployment import load_deployment
from specpipe.testing.greedy import assert_greedy_equivalent
from tests.test_cli_core import assert_one_line_error, run_cli


@pytest.fixture(scope="module")
def quant_build(tiny_target, tiny_draft, tmp_path_factory):
    from specpipe.builder import build
    from specpipe.builder.config import BuildConfig
    from specpipe.contract.quant import QuantConfig

    return build(BuildConfig(target=str(tiny_target), draft=str(tiny_draft), name="q",
                             engines_dir=tmp_path_factory.mktemp("qeng"), repo_dir=None,
                             quant=QuantConfig(mode="int8-wo"),
                             draft_quant=QuantConfig(mode="int4-wo", accept_accuracy_loss=True)))


def test_manifest_carries_accuracy_and_reference(quant_build):
    manifest = json.loads((quant_build / "manifest.json").read_text())
    target, draft = manifest["target"], manifest["draft"]
    assert target["engine"]["quant"] == "int8-wo" and draft["engine"]["quant"] == "int4-wo"
    accuracy = target["quant"]["accuracy"]
    assert 0.9 <= accuracy["top1_agreement"] <= 1.0 and accuracy["ppl_rel_change"] < 0.05
    assert (quant_build / target["quant"]["reference_path"] / "model.onnx").is_file()
    assert target["engine"]["files"]["model.onnx"]


def test_quantized_draft_never_changes_greedy_output(quant_build):
    deployment = load_deployment(quant_build, threads=1)
    for prompt in ["def add(a, b):", "The quick brown fox"]:
        cfg = GenerationConfig(max_new_tokens=32, stop_on_eos=False, num_draft_tokens=3, draft_length="fixed")
        spec = deployment.generator.generate(prompt, cfg)
        base = deployment.generator.generate(prompt, cfg.model_copy(update={"speculative": False}))
        assert_greedy_equivalent(deployment, prompt, spec.token_ids, base.token_ids)


def test_over_budget_build_fails_and_leaves_nothing(capsys, tiny_target, tmp_path):
    code, _, err = run_cli(capsys, "build", "--target", str(tiny_target), "--draft", str(tiny_target), "--no-repo",
                           "--quant", "int4-wo", "--min-top1-agreement", "1.0", "--max-ppl-increase", "0",
                           "--engines-dir", str(tmp_path), "--name", "over")
    assert_one_line_error(code, err, "accuracy budget")
    assert code == 1 and not (tmp_path / "over").exists()


def test_kv_cache_dtype_on_cpu_engine_is_refused(capsys, tiny_target, tmp_path):
    code, _, err = run_cli(capsys, "build", "--target", str(tiny_target), "--draft", str(tiny_target), "--no-repo",
                           "--kv-cache-dtype", "fp8", "--engines-dir", str(tmp_path))
    assert_one_line_error(code, err, "--kv-cache-dtype")


def test_unknown_quant_mode_is_refused(capsys, tiny_target, tmp_path):
    code, _, err = run_cli(capsys, "build", "--target", str(tiny_target), "--draft", str(tiny_target), "--quant", "int3",
                           "--engines-dir", str(tmp_path))
    assert code == 2 and "int3" in err and "Traceback" not in err
