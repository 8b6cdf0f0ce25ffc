"""Issue 18: with a quantized target, speculative greedy output must be the target's own.

A target's 1-token steps run as 2-row calls (engines/onnxruntime.py), so a position scores the same alone
and inside a verify call; the build measures that and records it, and the gate's greedy check uses it.
"""

import json

import numpy as np
import pytest

from specpipe.contract.generation import GenerationConfig
from specpipe.contract.quant import QuantConfig
from specpipe.deployment import load_deployment
from specpipe.engines.consistency import verify_consistency
from specpipe.engines.onnxruntime import OrtEngine
from specpipe.testing.greedy import assert_greedy_equivalent

PROMPTS = ["def add(a, b):", "The quick brown fox", "Héllo wörld 東京"]
CONTEXTS = [[5, 17, 42, 99, 7], [1, 2, 3], [100, 200, 150, 7, 8, 9, 10]]
MODES = ["none", "int8-wo", "int4-wo", "int8"]


@pytest.fixture(scope="module")
def engines(tiny_target, tmp_path_factory):
    """The tiny target's fp32 engine (optimum's graph, whose 1-token steps can be padded) quantized in every
    mode (int8 W8A8 calibrated on random ids)."""
    from specpipe.builder import build
    from specpipe.builder.config import BuildConfig
    from specpipe.quantize.pipeline import quantize_onnx

    out = tmp_path_factory.mktemp("modes")
    fp32 = build(BuildConfig(target=str(tiny_target), draft="none", name="optimum",
                             backend={"kind": "onnxruntime", "target_graph": "optimum"},
                             engines_dir=out, repo_dir=None)) / "target"
    rng = np.random.default_rng(0)
    calib = [[int(t) for t in rng.integers(3, 300, size=24)] for _ in range(8)]
    folders = {"none": fp32}
    for mode in MODES[1:]:
        quantize_onnx(fp32, out / mode, QuantConfig(mode=mode, accept_accuracy_loss=True), calib)
        folders[mode] = out / mode
    return folders


@pytest.mark.parametrize("mode", MODES)
def test_padded_one_token_steps_score_exactly_like_verify_rows(engines, mode):
    padded = verify_consistency(OrtEngine(engines[mode], threads=1, min_rows=2), CONTEXTS, new_tokens=60, chunk=5)
    assert padded.exact and padded.argmax_flips == 0 and padded.positions == 180


def test_padding_drops_the_extra_row_from_logits_and_cache(engines):
    plain, padded = (OrtEngine(engines["int8-wo"], threads=1, min_rows=rows).new_sequence() for rows in (1, 2))
    for sequence in (plain, padded):
        sequence.append(CONTEXTS[0])
    logits = padded.append([11])
    assert logits.shape == (1, plain.engine.vocab_size) and len(padded) == 6
    assert all(kv.shape[2] == 6 for kv in padded.kv)
    np.testing.assert_allclose(logits, plain.append([11]), atol=0.1)  # the same model, maybe another kernel


@pytest.fixture(scope="module", params=["int8-wo", "int4-wo"])
def quantized_target_build(request, tiny_target, tiny_draft, tmp_path_factory):
    from specpipe.builder import build
    from specpipe.builder.config import BuildConfig

    return build(BuildConfig(target=str(tiny_target), draft=str(tiny_draft), name=f"t-{request.param}",
                             engines_dir=tmp_path_factory.mktemp("qt"), repo_dir=None,
                             quant=QuantConfig(mode=request.param, accept_accuracy_loss=True)))


def test_build_records_the_target_as_verify_consistent(quantized_target_build):
    target = json.loads((quantized_target_build / "manifest.json").read_text())["target"]
    consistency = target["verify_consistency"]
    assert consistency["within_tolerance"] and consistency["positions"] > 0
    # Padded to 2 rows only where this machine's 1-row kernels moved the logits beyond the near-tie rule;
    # then the record keeps the unpadded difference that made build pad, and padding makes it exact.
    assert target["min_rows_per_call"] in (1, 2)
    if target["min_rows_per_call"] == 2:
        assert consistency["exact"] and consistency["unpadded_max_abs_logit_diff"] > 0
    else:
        assert "unpadded_max_abs_logit_diff" not in consistency


@pytest.mark.parametrize("k", [1, 3])
def test_quantized_target_speculative_greedy_is_the_targets_own(quantized_target_build, k):
    deployment = load_deployment(quantized_target_build, threads=1)
    for prompt in PROMPTS:
        cfg = GenerationConfig(max_new_tokens=48, stop_on_eos=False, num_draft_tokens=k, draft_length="fixed")
        spec = deployment.generator.generate(prompt, cfg)
        base = deployment.generator.generate(prompt, cfg.model_copy(update={"speculative": False}))
        assert_greedy_equivalent(deployment, prompt, spec.token_ids, base.token_ids)
        if deployment.manifest.target.verify_consistency.exact:
            assert spec.token_ids == base.token_ids  # bit-identical scoring: not even a near-tie may differ


def test_gate_greedy_check_on_a_quantized_build(quantized_target_build):
    from specpipe.gate.greedy import check_greedy
    from specpipe.gate.subjects import InProcessSubject
    from tests.test_gate import small_gate

    subject = InProcessSubject(load_deployment(quantized_target_build, threads=1))
    result = check_greedy(subject, small_gate(prompts=PROMPTS, greedy={"max_new_tokens": 24}), lambda n: None)
    assert result.status == "passed" and result.metrics["matched"] == len(PROMPTS), result.failures
    assert result.metrics["verify_consistency"]["within_tolerance"] and not result.warnings
    assert result.metrics["near_tie_margin"] == 1e-3  # the target precision's tolerance


def test_the_gate_times_the_target_alone_unpadded_and_checks_greedy_on_the_padded_target(quantized_target_build,
                                                                                          monkeypatch):
    """A deployment whose target pads its 1-token steps (forced here: whether this machine's kernels need it is
    measured at build) times its target-only run on the target as a draft-less deployment runs it, unpadded
    (Deployment.target_alone), while the greedy checks' target-only output stays the padded target's own."""
    from specpipe.gate.subjects import InProcessSubject
    from specpipe.speculative.generator import SpecGenerator

    deployment = load_deployment(quantized_target_build, threads=1)
    deployment.target.min_rows = 2
    ran = []
    generate = SpecGenerator.generate
    monkeypatch.setattr(SpecGenerator, "generate", lambda self, *a, **k: ran.append(
        (self.decoder.target.min_rows, self.decoder.drafter is None)) or generate(self, *a, **k))
    subject = InProcessSubject(deployment)
    subject.greedy_ids("def f(x):", 4, 0)
    for k in (None, 0):
        subject.timed_run(["def f(x):"], 4, k, 1, 1, 0, lambda n: None)
    assert ran == [(2, False), (2, False), (1, True)]  # greedy: padded; timed speculative: padded; timed alone: not
    deployment.target.min_rows = 1
    assert deployment.target_alone() is deployment.generator  # an unpadded target is its own baseline
