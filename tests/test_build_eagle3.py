"""`specpipe build --draft HEAD`: an EAGLE-3 head built into a deployment (builder/cpu.py, drafts/eagle3.py
Eagle3Draft and its drafter).

The tiny target has 2 layers, so the only layer whose output feeds another is layer 0: the tiny head reads
(0,), and a head reading (1,) is one this target cannot feed. The head is random (identity-fc warm start), so
it is accepted now and then: enough to show it drafts, and greedy output must equal the target alone's.
"""

from __future__ import annotations

import json

import pytest
import torch

from specpipe.builder.config import BuildConfig, DraftChoiceConfig

SMALL_SAMPLE = DraftChoiceConfig(choice_prompts=1, choice_tokens=16, choice_sets=["code"])


def _head(target, folder, layers):
    from transformers import AutoModelForCausalLM

    from specpipe.checkpoint.eagle3 import head_config, write_eagle3_head
    from specpipe.distill.eagle3 import make_head

    model = AutoModelForCausalLM.from_pretrained(target)
    head = make_head(model, feature_layers=layers, draft_token_ids=torch.arange(0, model.config.vocab_size, 2),
                     warm_start=True, warm_attention=False, seed=0)
    return write_eagle3_head(folder, head.state_dict(), head_config(head.shape))


@pytest.fixture(scope="module")
def tiny_head(tiny_target, tmp_path_factory):
    return _head(tiny_target, tmp_path_factory.mktemp("buildhead") / "head", (0,))


@pytest.fixture(scope="module")
def head_build(tiny_target, tiny_head, tmp_path_factory):
    from specpipe.builder import build

    engines = tmp_path_factory.mktemp("headbuild")
    return build(BuildConfig(target=str(tiny_target), draft=str(tiny_head), name="withhead", engines_dir=engines,
                             repo_dir=engines / "repo", stream_interval=2))


def test_build_writes_the_head_and_its_manifest_entry(head_build, tiny_head):
    from specpipe.drafts import read_manifest
    from specpipe.speculative.eagle3 import DEFAULT_HEAD_DRAFT_COST

    manifest = read_manifest(head_build)
    draft = manifest.draft
    assert draft.kind == "eagle3" and draft.source == str(tiny_head) and draft.feature_layers == [0]
    assert draft.draft_vocab_size == json.loads((tiny_head / "config.json").read_text())["draft_vocab_size"]
    assert (head_build / draft.path / "model.safetensors").is_file() and set(draft.files) >= {"config.json", "model.safetensors"}
    assert json.loads((head_build / "target" / "engine.json").read_text())["feature_layers"] == [0]
    assert manifest.target.engine.graph == "genai"
    assert 0 < manifest.step_costs.draft != DEFAULT_HEAD_DRAFT_COST  # measured on this machine, not the default
    assert draft.path in manifest.deployment_paths()
    # the head's dtype: each candidate timed here, the fastest kept
    assert draft.head_dtype in draft.head_step_ms and draft.head_dtype == min(draft.head_step_ms, key=draft.head_step_ms.get)
    # the Triton repository carries the head with the deployment (the served model opens it with load_deployment)
    served = next((head_build.parent / "repo").rglob("manifest.json")).parent
    assert (served / draft.path / "model.safetensors").is_file()
    # and the build's serving settings: --stream-interval lands in the model's parameters
    from specpipe.triton.model_config import read_config

    parameters = read_config(head_build.parent / "repo" / "ensemble").parameters
    assert parameters["stream_interval"].string_value == "2"


def test_the_deployment_drafts_with_the_head(head_build):
    from specpipe.deployment import load_deployment
    from specpipe.speculative.eagle3 import Eagle3Drafter

    deployment = load_deployment(head_build, threads=1)
    assert isinstance(deployment.drafter, Eagle3Drafter)
    assert deployment.costs == deployment.manifest.step_costs
    assert deployment.drafter.head.dtype == deployment.manifest.draft.head_dtype  # as the build timed it


def test_generate_from_the_build_equals_the_target_alone(head_build):
    from click.testing import CliRunner

    from specpipe.cli import cli
    from specpipe.speculative.equivalence import compare_greedy, near_tie_tolerance

    runner = CliRunner()
    args = ["generate", str(head_build), "-p", "def add(a, b):", "--max-tokens", "24", "--json"]
    spec = runner.invoke(cli, args + ["-k", "3"])
    base = runner.invoke(cli, args + ["--no-speculative"])
    assert spec.exit_code == 0 and base.exit_code == 0, spec.output + base.output
    spec_out, base_out = json.loads(spec.output), json.loads(base.output)
    assert spec_out["drafted"] > 0
    if spec_out["token_ids"] != base_out["token_ids"]:  # the project's near-tie rule: a flip only at a near-tie
        from specpipe.deployment import load_deployment

        deployment = load_deployment(head_build, threads=1)
        prompt = deployment.generator.encode("def add(a, b):", chat=False)
        divergence = compare_greedy(deployment.target, prompt, spec_out["token_ids"], base_out["token_ids"],
                                    near_tie_tolerance("none"))
        assert divergence.near_tie, divergence


def test_several_candidates_measure_the_head(tiny_target, tiny_head, tmp_path, monkeypatch):
    """The head is measured like the others, with its own measured step cost; deployed (the choice forced here:
    a random head on a loaded machine is rarely the fastest), its files and costs are the deployment's."""
    from specpipe.builder import build
    from specpipe.drafts import read_manifest
    from specpipe.deployment import load_deployment
    from specpipe.speculative.eagle3 import DEFAULT_HEAD_DRAFT_COST, Eagle3Drafter

    monkeypatch.setattr("specpipe.builder.draft_choice.choose", lambda measurements, min_speedup: (str(tiny_head), "forced"))
    folder = build(BuildConfig(target=str(tiny_target), draft=[str(tiny_head), "ngram", "none"], name="choice",
                               engines_dir=tmp_path, repo_dir=None, choice=SMALL_SAMPLE))
    manifest = read_manifest(folder)
    head = manifest.draft_choice.measurement(str(tiny_head))
    assert head.kind == "eagle3" and head.acceptance_rate is not None and head.predicted_speedup is not None
    assert 0 < head.step_costs.draft != DEFAULT_HEAD_DRAFT_COST
    assert head.matches_target == head.prompts
    assert manifest.draft.kind == "eagle3" and manifest.step_costs == head.step_costs
    assert not (folder / "candidates").exists() and (folder / manifest.draft.path / "model.safetensors").is_file()
    assert isinstance(load_deployment(folder, threads=1).drafter, Eagle3Drafter)


@pytest.mark.parametrize("case", ["layers", "graph"])
def test_a_head_the_target_cannot_feed_is_refused(tiny_target, tiny_head, tmp_path, capsys, case):
    from specpipe.cli import main

    head = _head(tiny_target, tmp_path / "head1", (1,)) if case == "layers" else tiny_head
    extra = ["--target-graph", "optimum"] if case == "graph" else []
    with pytest.raises(SystemExit) as exit_info:
        main(["build", "--target", str(tiny_target), "--draft", str(head), "--engines-dir", str(tmp_path / "e"),
              "--no-repo", *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err  # progress lines, then the error
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "EAGLE-3 head" in errors[0] and "Traceback" not in err, err
    assert not (tmp_path / "e").exists() or not any((tmp_path / "e").iterdir())


def test_a_head_naming_no_layers_reads_the_default_ones(tiny_tokenizer, tmp_path):
    """Upstream heads may leave eagle_config out: they read EAGLE-3's default layers (1, N/2-1, N-4)."""
    from specpipe.builder import build
    from specpipe.drafts import read_manifest
    from specpipe.deployment import load_deployment
    from specpipe.testing.tiny import make_tiny_llama

    target = make_tiny_llama(tmp_path / "target8", seed=2, num_layers=8, tokenizer=tiny_tokenizer)
    head = _head(target, tmp_path / "head", (1, 3, 4))
    config = json.loads((head / "config.json").read_text())
    del config["eagle_config"]
    (head / "config.json").write_text(json.dumps(config))
    folder = build(BuildConfig(target=str(target), draft=str(head), name="defaults", engines_dir=tmp_path / "e",
                               repo_dir=None))
    assert read_manifest(folder).draft.feature_layers == [1, 3, 4]
    deployment = load_deployment(folder, threads=1)
    assert deployment.drafter.head.feature_layers == (1, 3, 4)
    result = deployment.generator.generate("def add(a, b):", deployment.generation_config(max_new_tokens=12))
    assert result.stats.drafted > 0


def test_a_weight_only_quantized_target_feeds_the_head(tiny_target, tiny_head, tmp_path):
    """--quant int8-wo: the model builder quantizes the target with the head's feature outputs kept, so the head
    drafts for the quantized target and greedy output equals that target alone's. A calibrated mode (int8, optimum's
    graph) cannot output them and is refused in one line (the refusal test above covers the graph case)."""
    from specpipe.builder import build
    from specpipe.deployment import load_deployment
    from specpipe.drafts import read_manifest
    from click.testing import CliRunner

    from specpipe.engines.base import read_engine_meta
    from specpipe.cli import cli
    from specpipe.contract.quant import QuantConfig
    from specpipe.speculative.eagle3 import Eagle3Drafter
    from specpipe.speculative.equivalence import compare_greedy, near_tie_tolerance

    folder = build(BuildConfig(target=str(tiny_target), draft=str(tiny_head), name="q8head", engines_dir=tmp_path,
                               repo_dir=None, quant=QuantConfig(mode="int8-wo", accept_accuracy_loss=True)))
    manifest = read_manifest(folder)
    assert manifest.target.engine.quant == "int8-wo" and manifest.draft.kind == "eagle3"
    meta = read_engine_meta(folder / manifest.target.engine.path)
    assert meta["quant"] == "int8-wo" and meta["feature_layers"] == [0]
    deployment = load_deployment(folder, threads=1)
    assert isinstance(deployment.drafter, Eagle3Drafter)
    runner = CliRunner()
    args = ["generate", str(folder), "-p", "def add(a, b):", "--max-tokens", "24", "--json"]
    spec, base = runner.invoke(cli, args + ["-k", "3"]), runner.invoke(cli, args + ["--no-speculative"])
    assert spec.exit_code == 0 and base.exit_code == 0, spec.output + base.output
    spec_out, base_out = json.loads(spec.output), json.loads(base.output)
    assert spec_out["drafted"] > 0
    if spec_out["token_ids"] != base_out["token_ids"]:  # the project's near-tie rule: a flip only at a near-tie
        prompt = deployment.generator.encode("def add(a, b):", chat=False)
        divergence = compare_greedy(deployment.target, prompt, spec_out["token_ids"], base_out["token_ids"],
                                    near_tie_tolerance("int8-wo"))
        assert divergence.near_tie, divergence
