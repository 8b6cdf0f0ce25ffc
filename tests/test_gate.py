"""`specpipe validate` in-process: the statistics, the memo engine, passing and failing gates, reports, bad input.

The test gate (TEST_GATE) is smaller than the default gate so CI stays fast on 2 cores, and still proves
its power on the tiny random models: their next-token distributions are flat (top token ~0.07 at T=1),
so the distribution check samples at top_k=5 and claims TV >= 0.1 (default: top_k off, TV >= 0.05), with
100 planted replicates (default 200). That is ~6.5k in-process samples instead of ~30k.
"""

from __future__ import annotations

import html
import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from tests.test_cli_core import run_cli
from specpipe.gate import goodness, load_gate, run_gate
from specpipe.gate.config import GateConfig
from specpipe.speculative.verify import PLANTED_BIAS_ENV

TEST_GATE = {
    "prompts": ["def add(a, b):", "The quick brown fox"],
    "greedy": {"max_new_tokens": 16},
    "distribution": {
        "contexts": ["def add(a, b):\n    return", "The quick brown fox jumps over the"],
        "temperatures": [1.0],
        "top_k": 5,
        "tv": 0.1,
        "server_samples": 300,
        "planted_replicates": 100,
    },
    "latency": {"requests": 4, "warmup_requests": 1, "max_new_tokens": 16},
}


def small_gate(**sections) -> GateConfig:
    merged = {key: dict(value) if isinstance(value, dict) else value for key, value in TEST_GATE.items()}
    for key, value in sections.items():
        merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
    return GateConfig.model_validate(merged)



def write_toml(path, text: str):
    path.write_text(text)
    return path


def validate(capsys, *args) -> tuple[int, str, str]:
    """`specpipe validate ARGS` through the real entry point: (exit code, stdout, stderr)."""
    return run_cli(capsys, "validate", *map(str, args))


def one_line_error(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error:") and "Traceback" not in err, err
    return lines[-1]


# ---- statistics ------------------------------------------------------------------------------


def test_required_samples_reaches_the_power_and_one_fewer_does_not():
    for df in (1, 4, 31):
        n = goodness.required_samples(df, tv=0.05, alpha=1e-3, power=0.99)
        assert goodness.power_at(n, df, 0.05, 1e-3) >= 0.99 > goodness.power_at(n - 1, df, 0.05, 1e-3)
        assert goodness.detectable_tv(n, df, 1e-3, 0.99) == pytest.approx(0.05, rel=1e-3)


def test_planted_distribution_is_off_by_exactly_tv():
    probs = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    planted = goodness.planted_probs(probs, 0.05)
    assert planted.sum() == pytest.approx(1.0)
    assert 0.5 * np.abs(planted - probs).sum() == pytest.approx(0.05)
    assert (planted > 0).all()


def test_power_claim_holds_empirically():
    """At the sample size the power analysis asks for, a planted error of size tv is caught ~power of the time."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(12))
    bins = goodness.pool_bins(p, 10_000, 5.0)
    n = goodness.required_samples(bins.df, 0.05, 1e-3, 0.9)
    rate = goodness.planted_rejection_rate(bins, n, 0.05, 1e-3, 2000, rng)
    assert 0.87 <= rate <= 0.95  # least detectable direction: about the stated 0.9, not far above


def test_pool_bins_respects_min_expected_and_max_bins():
    p = np.r_[0.5, np.full(100, 0.5 / 100), np.zeros(10)]
    bins = goodness.pool_bins(p, 1000, 5.0, max_bins=8)
    assert len(bins.probs) == 8 and bins.pooled
    assert (1000 * bins.probs >= 5.0).all()
    assert bins.probs.sum() == pytest.approx(1.0)


def test_chisquare_accepts_the_right_sampler_and_rejects_a_wrong_one():
    rng = np.random.default_rng(1)
    p = np.array([0.4, 0.3, 0.2, 0.1, 0.0])
    bins = goodness.pool_bins(p, 5000, 5.0)
    right = goodness.chisquare_fit(rng.choice(5, 5000, p=p), bins)
    wrong = goodness.chisquare_fit(rng.choice(5, 5000, p=[0.35, 0.3, 0.2, 0.15, 0.0]), bins)
    impossible = goodness.chisquare_fit(np.r_[rng.choice(5, 999, p=p), 4], bins)
    assert not right.rejected(1e-3)
    assert wrong.rejected(1e-3)
    assert impossible.impossible == 1 and impossible.rejected(1e-3)


def test_memo_engine_returns_the_engines_logits(tiny_build):
    from specpipe.engines import load_engine
    from specpipe.gate.memo import MemoEngine

    engine = load_engine(tiny_build / "target")
    memo = MemoEngine(engine)
    rng = np.random.default_rng(0)
    base = list(rng.integers(3, engine.vocab_size, 6))
    for _ in range(20):  # random branches off a shared prefix, as the sampler makes them
        tokens = base + list(rng.integers(3, 12, rng.integers(1, 4)))
        seq = memo.new_sequence()
        seq.append(tokens[:4])
        got = seq.append(tokens[4:])
        want = engine.new_sequence().append(tokens)[4:]
        np.testing.assert_allclose(got, want, atol=1e-4)
    assert memo.hits > 0


# ---- the gate in-process ---------------------------------------------------------------------


def _junit_counts_match(path, report):
    suite = ET.parse(path).getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == [c.name for c in report.checks]
    assert int(suite.get("tests")) == len(cases) == 5
    for tag, attr in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
        assert int(suite.get(attr)) == sum(c.find(tag) is not None for c in cases)
    return {c.get("name"): c for c in cases}


def test_passing_gate_in_process(tiny_build, tmp_path):
    report = run_gate(tiny_build, small_gate(), "in-process", tmp_path / "report", progress=False)
    statuses = {c.name: c.status for c in report.checks}
    assert statuses == {
        "greedy_equivalence": "passed", "distribution_equivalence": "passed", "quantization_accuracy": "passed",
        "latency_slo": "passed", "robustness": "skipped",
    }, report.summary_lines()
    assert report.passed and report.exit_code == 0

    dist = report.check("distribution_equivalence").metrics
    assert all(t["informative"] for t in dist["tests"])
    assert all(t["planted_rejection_rate"] >= 0.9 for t in dist["tests"])
    assert dist["detectable_tv_worst"] <= 0.1
    assert all(t["p_value"] >= dist["alpha_per_test"] for t in dist["tests"])
    greedy = report.check("greedy_equivalence").metrics
    assert greedy["matched"] == greedy["prompts"] == 2
    assert "not applicable" in report.check("quantization_accuracy").summary

    cases = _junit_counts_match(tmp_path / "report" / "junit.xml", report)
    assert cases["robustness"].find("skipped") is not None
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["passed"] is True and [c["name"] for c in saved["checks"]] == [c.name for c in report.checks]
    for name in ("report.html", "latency.png", "acceptance.png", "throughput.png"):
        assert (tmp_path / "report" / name).stat().st_size > 0
    assert "distribution_equivalence" in (tmp_path / "report" / "report.html").read_text()
    # Where the latencies were measured: report.json, the HTML page and the junit properties name the machine.
    assert saved["machine"]["summary"] == report.machine["summary"] and saved["machine"]["threads"]["in_use"] == 2
    assert set(saved["machine"]["isa"]) >= {"avx2", "avx512f", "avx512_bf16", "amx_tile"}
    assert f"measured on: {html.escape(report.machine['summary'])}" in (tmp_path / "report" / "report.html").read_text()
    properties = {p.get("name"): p.get("value") for p in ET.parse(tmp_path / "report" / "junit.xml").iter("property")}
    assert properties["machine"] == report.machine["summary"]


def test_planted_bias_fails_the_distribution_check(tiny_build, tmp_path, monkeypatch, capsys):
    """The test-only switch makes verify_sampled accept every draft: the gate must fail, naming the check."""
    monkeypatch.setenv(PLANTED_BIAS_ENV, "always-accept")
    gate = write_toml(tmp_path / "gate.toml", _toml(small_gate(latency={"enabled": False})))
    code, out, err = validate(capsys, tiny_build, "--in-process", "--gate", gate, "--report-dir", tmp_path / "r", "--quiet")
    assert code == 1, out + err
    assert "gate failed: distribution_equivalence" in one_line_error(err)
    assert "FAILED  distribution_equivalence" in out
    assert "PASSED  greedy_equivalence" in out  # greedy decoding never samples: unaffected

    saved = json.loads((tmp_path / "r" / "report.json").read_text())
    failed = [c["name"] for c in saved["checks"] if c["status"] == "failed"]
    assert failed == ["distribution_equivalence"]
    cases = {c.get("name"): c for c in ET.parse(tmp_path / "r" / "junit.xml").getroot().iter("testcase")}
    failure = cases["distribution_equivalence"].find("failure")
    assert failure is not None and "first token" in failure.text
    assert "target probability 0" in failure.text or "do not follow the target's p" in failure.text
    suite = ET.parse(tmp_path / "r" / "junit.xml").getroot().find("testsuite")
    assert suite.get("failures") == "1" and suite.get("tests") == "5"


def test_impossible_slo_fails_the_latency_check(tiny_build, tmp_path):
    gate = small_gate(
        greedy={"enabled": False},
        distribution={"enabled": False},
        latency={"ttft_ms_p50_max": 1e-6, "tokens_per_s_min": 1e9, "speedup_min": 1e6},
    )
    report = run_gate(tiny_build, gate, "in-process", tmp_path / "r", progress=False)
    latency = report.check("latency_slo")
    assert latency.status == "failed" and report.failed_checks() == ["latency_slo"]
    assert len(latency.failures) == 3
    assert any("ttft_ms_p50 = " in f and "> ttft_ms_p50_max 1e-06" in f for f in latency.failures)
    assert set(latency.metrics["thresholds"]) == {"ttft_ms_p50_max", "tokens_per_s_min", "speedup_min"}
    assert "itl_ms_p95_max" in latency.metrics["report_only"]
    assert {c.name: c.status for c in report.checks}["greedy_equivalence"] == "skipped"
    _junit_counts_match(tmp_path / "r" / "junit.xml", report)


# ---- the gate file and bad input -------------------------------------------------------------


def _toml(gate: GateConfig) -> str:
    """A GateConfig as a TOML gate file (test helper: None values are left out, as in a real file)."""
    def value(v):
        return json.dumps(v)  # JSON scalars and arrays of them are valid TOML

    lines = []
    data = gate.model_dump(mode="json", exclude_none=True)
    for key, v in data.items():
        if not isinstance(v, dict):
            lines.append(f"{key} = {value(v)}")
    for key, v in data.items():
        if isinstance(v, dict):
            lines.append(f"[{key}]")
            lines += [f"{k} = {value(x)}" for k, x in v.items()]
    return "\n".join(lines) + "\n"


def test_example_gate_file_is_valid_and_names_every_latency_key():
    from specpipe.gate.latency import THRESHOLDS

    gate = load_gate("build/gate.toml")
    text = open("build/gate.toml").read()
    for key in list(THRESHOLDS) + ["concurrency"]:
        assert f"{key} =" in text
    assert gate.latency.concurrency >= 1 and gate.distribution.tv == 0.05


def test_default_gate_without_a_file():
    assert load_gate(None) == GateConfig()


def test_missing_gate_file(tiny_build, tmp_path, capsys):
    code, _, err = validate(capsys, tiny_build, "--in-process", "--gate", tmp_path / "nope.toml")
    assert code == 2
    assert "gate file not found" in one_line_error(err)


def test_unknown_keys_in_the_gate_file(tiny_build, tmp_path, capsys):
    gate = write_toml(tmp_path / "g.toml", "[latency]\nttft_p50_max = 3\n[distribution]\nsamples = 10\n[extra]\n")
    code, _, err = validate(capsys, tiny_build, "--in-process", "--gate", gate)
    assert code == 2
    message = one_line_error(err)
    assert "latency.ttft_p50_max: unknown key" in message
    assert "distribution.samples: unknown key" in message and "extra: unknown key" in message


def test_bad_values_and_bad_toml_in_the_gate_file(tmp_path):
    from specpipe.errors import GateError

    with pytest.raises(GateError, match="latency.concurrency"):
        load_gate(write_toml(tmp_path / "a.toml", "[latency]\nconcurrency = 0\n"))
    with pytest.raises(GateError, match="temperatures"):
        load_gate(write_toml(tmp_path / "b.toml", "[distribution]\ntemperatures = [0.0]\n"))
    with pytest.raises(GateError, match="not valid TOML"):
        load_gate(write_toml(tmp_path / "c.toml", "[latency\n"))


@pytest.mark.timing
def test_unreachable_url_is_a_fast_clear_error(tiny_build, capsys):
    """Fast by construction, not by a stopwatch: one readiness check bounded by check_ready's timeout (the
    message names it), no wait for a server to come up."""
    from specpipe.triton.client import check_ready
    from specpipe.triton.server import free_port

    code, _, err = validate(capsys, "--url", f"127.0.0.1:{free_port()}", "--engines", tiny_build)
    assert code == 2
    bound = check_ready.__defaults__[-1]
    assert "cannot reach a Triton server" in one_line_error(err) and f"within {bound:g} s" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--url", "127.0.0.1:1"], "--engines"),
        ([], "give TARGET"),
        (["{engines}"], "add --in-process"),
        (["{engines}", "--url", "127.0.0.1:1"], "not both"),
        (["{missing}", "--in-process"], "no such engines folder"),
    ],
)
def test_usage_errors(tiny_build, tmp_path, capsys, args, message):
    args = [a.format(engines=tiny_build, missing=tmp_path / "missing") for a in args]
    code, out, err = validate(capsys, *args)
    assert code == 2, out + err
    assert message in one_line_error(err)


# ---- quantization accuracy from the manifest ---------------------------------------------------


def _quant_entry(mode: str, ppl_rel_change: float, top1: float) -> dict:
    """A manifest role entry as `specpipe build` records a quantized engine (specpipe.quantize.quantize_engine)."""
    accuracy = {
        "mode": mode, "num_sequences": 4, "num_positions": 400, "ppl_ref": 10.0, "ppl_quant": 10.0 * (1 + ppl_rel_change),
        "ppl_rel_change": ppl_rel_change, "top1_agreement": top1, "mean_kl": 0.01, "max_kl": 0.2,
    }
    budget = {"max_ppl_increase": 0.05, "min_top1_agreement": 0.9, "max_mean_kl": None}
    return {"source": "m", "engine": {"path": "target", "quant": mode}, "quant": {"mode": mode, "accuracy": accuracy, "budget": budget}}


def _manifest(target: dict, draft: dict):
    from specpipe.drafts import manifest_of

    return manifest_of(dict(name="m", created="", tokenizer={"hash": "h"}, target=target, draft={"kind": "model", **draft}))


def test_quantization_check_reads_the_manifest(tmp_path):
    from specpipe.gate.quantization import check_quantization

    fp32 = {"source": "m", "engine": {"path": "draft", "quant": "none"}}
    not_applicable = check_quantization(_manifest(fp32, fp32), tmp_path, GateConfig())
    assert not_applicable.status == "passed" and "not applicable" in not_applicable.summary

    within = check_quantization(_manifest(_quant_entry("int8-wo", 0.01, 0.97), fp32), tmp_path, GateConfig())
    assert within.status == "passed" and within.metrics["engines"]["target"]["mode"] == "int8-wo"

    over = check_quantization(_manifest(_quant_entry("int4-wo", 0.12, 0.85), fp32), tmp_path, GateConfig())
    assert over.status == "failed"
    assert any("perplexity increase = 0.12" in f for f in over.failures)
    assert any("top-1 agreement = 0.85" in f for f in over.failures)

    # The gate file's budget overrides the recorded one; a draft over budget only warns (lossless decoding).
    strict = small_gate(quantization={"min_top1_agreement": 0.99})
    draft_over = check_quantization(_manifest(fp32, _quant_entry("int4-wo", 0.01, 0.97)), tmp_path, strict)
    assert draft_over.status == "passed" and draft_over.warnings and "top-1 agreement" in draft_over.warnings[0]


# ---- greedy mismatches: real bug vs numerical near-tie ---------------------------------------------


def test_greedy_mismatch_reports_position_tokens_and_margin(tiny_build):
    from specpipe.deployment import load_deployment
    from specpipe.gate.greedy import check_greedy
    from specpipe.gate.subjects import InProcessSubject

    class FlipsTheFourthToken(InProcessSubject):
        """A planted bug in the speculative path: its 4th output token is replaced."""

        def greedy_ids(self, prompt, max_new_tokens, num_draft_tokens):
            ids = super().greedy_ids(prompt, max_new_tokens, num_draft_tokens)
            if num_draft_tokens > 0:
                ids[3] = (ids[3] + 1) % self.reference.target.vocab_size
            return ids

    subject = FlipsTheFourthToken(load_deployment(tiny_build))
    gate = small_gate(prompts=["def add(a, b):"], greedy={"max_new_tokens": 8, "near_tie_margin": 1e-3})
    bug = check_greedy(subject, gate, lambda n: None)
    assert bug.status == "failed" and len(bug.failures) == 1
    entry = bug.metrics["per_prompt"][0]
    vocab = subject.reference.target.vocab_size
    assert entry["position"] == 3 and entry["speculative_token"] == (entry["target_only_token"] + 1) % vocab
    assert entry["reference_argmax"] == entry["target_only_token"] and entry["top2_logit_margin"] > 1e-3
    assert "position 3" in bug.failures[0] and "not a near-tie" in bug.failures[0]

    # The same mismatch under a margin larger than the real one counts as a near-tie: a warning, not a failure.
    tie = check_greedy(subject, small_gate(prompts=["def add(a, b):"], greedy={"max_new_tokens": 8, "near_tie_margin": 1e9}),
                       lambda n: None)
    assert tie.status == "passed" and tie.metrics["near_ties"] == 1 and "near-tie" in tie.warnings[0]


def test_acceptance_below_the_minimum_fails_only_when_the_drafts_show_it():
    from specpipe.gate.latency import acceptance_below

    assert not acceptance_below(0, 2, 0.05)  # the batch plan drafted twice: nothing to tell
    assert not acceptance_below(0, 0, 0.05)
    assert acceptance_below(0, 100, 0.05)  # a broken draft: p = 0.95^100 = 0.006
    assert acceptance_below(1, 200, 0.05)
    assert not acceptance_below(30, 100, 0.05)  # a working draft
