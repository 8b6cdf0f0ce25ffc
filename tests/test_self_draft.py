"""Drafts that need no second model, built and served like a model draft: `--draft ngram` and
`--draft self:int4-wo` / `self:int8-wo` (the target's own weight-only quantized engine)."""

from __future__ import annotations

import json

import pytest

from specpipe.cli import main
from specpipe.contract.generation import GenerationConfig
from specpipe.deployment import load_deployment
from specpipe.speculative.drafters import ModelDrafter
from specpipe.speculative.ngram import NgramDrafter
from specpipe.testing.greedy import assert_greedy_equivalent
from tests.test_cli_core import run_cli

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(", "The quick brown fox. The quick brown"]


def build_args(target, engines_dir, name, *extra):
    return ["build", "--target", str(target), "--name", name, "--engines-dir", str(engines_dir), "--no-repo", *extra]


@pytest.fixture(scope="module")
def builds(tmp_path_factory, tiny_target):
    """engines/ngram, engines/self-int4 and engines/int8-self-int4 (a quantized target), built through the CLI."""
    engines = tmp_path_factory.mktemp("nomodel-engines")
    for name, draft in [("ngram", ["--draft", "ngram", "--ngram-max", "4", "--ngram-min", "2"]),
                        ("self-int4", ["--draft", "self:int4-wo"]),
                        ("int8-self-int4", ["--draft", "self:int4-wo", "--quant", "int8-wo", "--accept-accuracy-loss"])]:
        with pytest.raises(SystemExit) as exc:
            main(build_args(tiny_target, engines, name, *draft))
            raise SystemExit(0)
        assert not exc.value.code
    return engines


def _greedy_equivalence(deployment):
    for prompt in PROMPTS:
        base = deployment.generator.generate(prompt, GenerationConfig(max_new_tokens=40, speculative=False, stop_on_eos=False))
        for cfg in [GenerationConfig(max_new_tokens=40, stop_on_eos=False),
                    GenerationConfig(max_new_tokens=40, stop_on_eos=False, draft_length="fixed", num_draft_tokens=3)]:
            spec = deployment.generator.generate(prompt, cfg)
            assert_greedy_equivalent(deployment, prompt, spec.token_ids, base.token_ids)
            yield spec


def test_ngram_build_records_the_strategy_and_generates_like_the_target(builds):
    manifest = json.loads((builds / "ngram" / "manifest.json").read_text())
    assert manifest["draft"] == {"kind": "ngram", "source": "ngram", "ngram": {"ngram_max": 4, "ngram_min": 2}}
    assert not (builds / "ngram" / "draft").exists()  # nothing to build, nothing on disk
    deployment = load_deployment(builds / "ngram", threads=1)
    assert isinstance(deployment.drafter, NgramDrafter)
    assert (deployment.drafter.config.ngram_max, deployment.drafter.config.ngram_min) == (4, 2)
    assert sum(spec.stats.drafted for spec in _greedy_equivalence(deployment)) > 0


def test_self_draft_build_is_the_target_quantized(builds):
    manifest = json.loads((builds / "self-int4" / "manifest.json").read_text())
    draft = manifest["draft"]
    assert draft["kind"] == "self" and draft["engine"]["quant"] == "int4-wo"
    assert draft["source"].startswith("self:int4-wo of ")
    assert 0.0 <= draft["quant"]["accuracy"]["top1_agreement"] <= 1.0
    assert draft["quant"]["dst_bytes"] < draft["quant"]["src_bytes"]
    deployment = load_deployment(builds / "self-int4", threads=1)
    assert isinstance(deployment.drafter, ModelDrafter)
    for _ in _greedy_equivalence(deployment):
        pass


def test_self_draft_of_a_quantized_target_starts_from_the_unquantized_engine(builds):
    manifest = json.loads((builds / "int8-self-int4" / "manifest.json").read_text())
    assert manifest["target"]["engine"]["quant"] == "int8-wo"
    assert manifest["draft"]["quant"]["reference_path"] == manifest["target"]["quant"]["reference_path"] == "target-fp32"
    assert manifest["draft"]["quant"]["mode"] == "int4-wo"
    for _ in _greedy_equivalence(load_deployment(builds / "int8-self-int4", threads=1)):
        pass


def test_generate_cli_on_an_ngram_build(capsys, builds):
    code, out, _ = run_cli(capsys, "generate", str(builds / "ngram"), "-p", PROMPTS[1], "--max-tokens", "16", "--json")
    assert code == 0 and json.loads(out)["num_generated"] <= 16


@pytest.mark.parametrize(
    "draft_args, needle",
    [
        (["--draft", "ngram", "--ngram-min", "0"], "--ngram-min"),
        (["--draft", "ngram", "--ngram-min", "4", "--ngram-max", "3"], "ngram_min 4 > ngram_max 3"),
        (["--draft", "self:int3"], "self:int3"),
    ],
)
def test_bad_draft_options_are_one_line_errors(capsys, tmp_path, tiny_target, draft_args, needle):
    code, out, err = run_cli(capsys, *build_args(tiny_target, tmp_path / "engines", "bad", *draft_args))
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], err
    assert not (tmp_path / "engines" / "bad").exists()
