"""The serving profile's parts: the scheduler's call trace, the served model's profile file, the breakdown of a
window, and the served target's worker threads that block instead of spinning."""

from __future__ import annotations

import json

import pytest

from specpipe.bench.serve_profile import breakdown
from specpipe.contract.generation import GenerationConfig
from specpipe.deployment import load_deployment
from specpipe.speculative.batching import StepTrace
from specpipe.triton.profile import PROFILE_ENV, ServedProfile

SPINNING = "session.intra_op.allow_spinning"


@pytest.fixture(scope="module")
def served(tiny_build):
    return load_deployment(tiny_build, threads=1, batching=True)


@pytest.mark.timing  # the scheduler's thread runs the request (one request: no race to lose)
def test_the_trace_counts_every_token_of_a_request_in_its_calls(served):
    """Target alone, no EOS: the prompt's call gives the first token and each decode call one more."""
    scheduler = served.generator.decoder
    scheduler.trace = StepTrace()
    try:
        cfg = served.generation_config(**GenerationConfig(max_new_tokens=9, speculative=False, stop_on_eos=False).model_dump())
        result = served.generator.generate("def add(a, b):", cfg)
        summary = scheduler.trace.summary()
    finally:
        scheduler.trace = None
    kinds = summary["kinds"]
    assert set(kinds) == {"prefill", "decode"}
    assert kinds["prefill"]["rows"] == 1 and kinds["prefill"]["tokens"] == result.prompt_len
    assert kinds["decode"]["tokens"] == len(result.token_ids) - 1 == kinds["decode"]["calls"]
    assert 0 < summary["busy_s"] <= summary["span_s"]


def test_a_breakdown_splits_the_window_into_calls_and_the_rest():
    calls = [("decode", 4, 4, 10.0, 10.5), ("prefill", 1, 20, 10.5, 10.8), ("decode", 4, 4, 11.0, 11.4),
             ("decode", 4, 4, 9.0, 9.5)]  # the last started before the window
    result = breakdown(calls, (10.0, 12.0))
    kinds = result["kinds"]
    assert (kinds["decode"]["calls"], kinds["decode"]["tokens"]) == (2, 8)
    assert kinds["decode"]["s"] == pytest.approx(0.9) and kinds["prefill"]["share"] == pytest.approx(0.15)
    assert kinds["between calls"]["s"] == pytest.approx(0.8)
    assert sum(k["share"] for k in kinds.values()) == pytest.approx(1.0)


@pytest.mark.timing  # the scheduler's thread runs the request (one request: no race to lose)
def test_the_served_profile_is_off_unless_asked_and_written_where_asked(served, tmp_path, monkeypatch):
    scheduler = served.generator.decoder
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    assert ServedProfile.from_env(scheduler) is None and scheduler.trace is None
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "profile"))
    profile = ServedProfile.from_env(scheduler)
    try:
        served.generator.generate("hello", served.generation_config(max_new_tokens=4))
        answer = profile.answer()
        answer.responses, answer.tokens = 2, 4
        written = json.loads(profile.write().read_text())
    finally:
        scheduler.trace = None
    assert written["calls"] and {c[0] for c in written["calls"]} >= {"prefill"}
    assert written["answers"][0]["tokens"] == 4 and written["scheduler_thread_id"] == scheduler.thread_id


def _spinning(deployment) -> str:
    options = deployment.target.session.get_session_options()
    try:
        return options.get_session_config_entry(SPINNING)
    except Exception:  # not set: ONNX Runtime's default, spinning
        return "default"


def test_the_served_target_blocks_instead_of_spinning_and_others_keep_the_default(tiny_build):
    assert _spinning(load_deployment(tiny_build, threads=1, batching=True, spinning=False)) == "0"
    assert _spinning(load_deployment(tiny_build, threads=1)) == "default"


@pytest.mark.timing
def test_a_profiled_level_through_the_real_server_accounts_for_its_window(tiny_build, tmp_path):
    from specpipe.bench.serve_profile import profile_level

    result = profile_level(tiny_build, users=2, per_user=2, max_tokens=8, out_dir=tmp_path)
    assert result["level"]["errors"] == 0 and result["tokens"] == 2 * 2 * 8
    [scheduler] = result["scheduler_whole_level"]  # one instance, one profile file (4 short requests: the
    # steady window, every user in flight, may hold no call at all)
    assert "decode" in scheduler["kinds"] and "prefill" in scheduler["kinds"]
    assert sum(k["share"] for k in scheduler["kinds"].values()) == pytest.approx(1.0)
    assert result["answers"]["requests"] == 4 and result["answers"]["tokens_per_response"] > 0.5  # + a final response each
