"""The soak (bench/soak.py): the short version `make test` runs through the real server, and its judgement.

The long one is `make soak` (16 streams x 100 requests on the demo's deployment); this one runs the same code and
the same assertions with a few streams and requests on the tiny pair (a deployed model draft)."""

from __future__ import annotations

import pytest

from specpipe.bench.config import SoakConfig
from specpipe.bench.soak import BatchOneReference, SoakReport, check_greedy, is_greedy, request_mix, run_soak
from specpipe.contract.generation import GenerationConfig
from specpipe.triton.load import RequestRecord

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def reference(tiny_build):
    return BatchOneReference(tiny_build, threads=1)


def _record(index: int, token_ids: list[int]) -> RequestRecord:
    return RequestRecord(index, 0, 0.0, total_ms=1.0, result={"token_ids": token_ids})


def test_the_mix_has_greedy_and_sampled_requests_longest_first():
    mix = request_mix([8, 24])
    assert [c.max_new_tokens for c in mix[:6]] == [24] * 6 and mix[-1].max_new_tokens == 8
    assert any(not is_greedy(c) for c in mix) and any(not c.speculative for c in mix)
    assert any(c.draft_length == "fixed" for c in mix) and any(not c.stop_on_eos for c in mix)


def test_a_greedy_output_equal_to_its_batch_one_output_passes_and_a_changed_token_fails(reference):
    cfg = GenerationConfig(max_new_tokens=12)
    alone = reference.output(PROMPT, cfg)
    requests = [(PROMPT, cfg)] * 3
    planted = list(alone)
    planted[5] = (planted[5] + 1) % reference.deployment.target.vocab_size  # a token the target did not choose
    checked, mismatches, near_ties = check_greedy([_record(0, alone), _record(1, planted), _record(2, alone)],
                                                  requests, reference)
    assert checked == 3 and near_ties == 0
    assert [m["index"] for m in mismatches] == [1] and mismatches[0]["position"] == 5


def test_sampled_requests_and_failed_ones_are_not_compared(reference):
    sampled = request_mix([8])[4]
    assert not is_greedy(sampled)
    failed = RequestRecord(1, 0, 0.0, error="server busy")
    checked, mismatches, _ = check_greedy([_record(0, [1, 2, 3]), failed], [(PROMPT, sampled), (PROMPT, GenerationConfig())],
                                          reference)
    assert (checked, mismatches) == (0, [])


def _report(**changes) -> SoakReport:
    fields = dict(requests=10, errors=[], rss_mb=(1000.0, 1020.0), rss_series_mb=[1000.0, 1020.0], greedy_checked=5, mismatches=[], near_ties=0,
                  tokens=100, wall_s=1.0, rss_growth_limit=0.05)
    return SoakReport(**{**fields, **changes}).judge()


def test_the_judgement_names_every_failed_condition():
    assert _report().failures == []
    failed = _report(errors=["request 3: boom"], rss_mb=(1000.0, 1060.0), mismatches=[{"index": 4, "position": 2}])
    assert len(failed.failures) == 3
    assert "6.0%" in failed.failures[1] and "request 4" in failed.failures[2]
    assert _report(rss_mb=(None, None)).failures == ["the server's memory could not be measured"]


@pytest.mark.timing
def test_a_short_soak_through_the_real_server_passes(tiny_build):
    """3 streams x 8 requests, every setting of the mix: 0 errors, memory < 5% growth, greedy = batch 1. The
    assertions hold whatever the thread timing (which requests share a batch only changes how fast it runs)."""
    report = run_soak(SoakConfig(streams=3, requests_per_stream=8, max_tokens=[6, 16], threads=1), tiny_build)
    assert report.failures == [], report.as_dict()
    assert report.requests == 24 and not report.errors
    assert report.greedy_checked >= 12  # 4 of the 6 settings are greedy
