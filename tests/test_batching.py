"""Continuous batching: the shared-KV engine, the scheduler's exactness, planted batching bugs, load-aware K."""

import threading

import numpy as np
import pytest
import torch

from specpipe.config import GenerationConfig, SamplingConfig, parse_draft_schedule
from specpipe.deployment import load_deployment, make_scheduler
from specpipe.manifest import ServingRecord
from specpipe.engines.shared_kv import KVBatch, SharedKVEngine
from specpipe.speculative import SpecStats
from specpipe.speculative.adaptive import BatchCosts, StepCosts, plan_batch_draft_lengths, scheduled_draft_length
from specpipe.speculative.batching import BatchScheduler, ServerBusyError
from specpipe.speculative.ngram import NgramDrafter
from specpipe.config import NgramConfig
from specpipe.testing.greedy import assert_greedy_equivalent

from tests.test_decoding import CONTEXT, SAMPLED, chi_square_pvalue, first_two_tokens, target_probs


@pytest.fixture(scope="module")
def pair(tiny_build):
    return load_deployment(tiny_build, threads=1)


@pytest.fixture(scope="module")
def torch_target(tiny_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target).eval()


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def prompts_of(lengths, seed=0, vocab=300):
    rng = np.random.default_rng(seed)
    prompts = [list(map(int, rng.integers(3, vocab, size=n))) for n in lengths]
    prompts[1] = prompts[1][:6] * 5  # repeats: prompt lookup finds drafts
    return prompts


# ---- the engine -------------------------------------------------------------------------------------


def test_build_makes_the_target_a_shared_kv_engine(pair):
    assert isinstance(pair.target, SharedKVEngine)
    assert pair.manifest.target.engine.graph == "genai"
    assert set(pair.manifest.batch_costs.decode_ms) >= {1, 2, 16}
    assert pair.manifest.serving.max_batch_size == 16


def test_rows_of_different_lengths_decode_together_as_torch_does(pair, torch_target):
    """Ragged rows in one call, a verify call inside the batch, rollback, and a released row's slot reused."""
    prompts, more = prompts_of([5, 11, 3, 8]), prompts_of([12, 12, 12, 12], seed=1)
    references = [torch_logits(torch_target, p + m) for p, m in zip(prompts, more)]
    batch = pair.target.new_batch(4)
    rows = [batch.new_sequence() for _ in prompts]
    for row, p, ref in zip(rows, prompts, references):
        np.testing.assert_allclose(row.append(p), ref[: len(p)], atol=1e-4)
    for t in range(4):
        logits = batch.decode(rows, [m[t] for m in more])
        for i, (p, ref) in enumerate(zip(prompts, references)):
            np.testing.assert_allclose(logits[i], ref[len(p) + t], atol=1e-4)
    verify = rows[1].append(more[1][4:8])  # one row runs K+1 tokens alone, in place
    np.testing.assert_allclose(verify, references[1][len(prompts[1]) + 4 : len(prompts[1]) + 8], atol=1e-4)
    rows[1].truncate(len(prompts[1]) + 5)  # reject the last 3: a length change only
    batch.release(rows[0])  # the last row moves into slot 0
    rows = rows[1:]
    logits = batch.decode(rows, [more[1][5], more[2][4], more[3][4]])
    np.testing.assert_allclose(logits[0], references[1][len(prompts[1]) + 5], atol=1e-4)
    np.testing.assert_allclose(logits[1], references[2][len(prompts[2]) + 4], atol=1e-4)
    np.testing.assert_allclose(logits[2], references[3][len(prompts[3]) + 4], atol=1e-4)


def test_the_buffer_grows_past_its_first_capacity(pair, torch_target):
    batch = pair.target.new_batch(2)
    rows = [batch.new_sequence() for _ in range(2)]
    long = [int(t) for t in np.random.default_rng(3).integers(3, 300, size=300)]
    rows[0].append([5, 6, 7])
    rows[1].append(long)  # beyond the first 256 tokens of capacity: the buffer doubles, rows keep their cache
    logits = batch.decode(rows, [8, 9])
    np.testing.assert_allclose(logits[0], torch_logits(torch_target, [5, 6, 7, 8])[-1], atol=1e-4)
    np.testing.assert_allclose(logits[1], torch_logits(torch_target, long + [9])[-1], atol=1e-4)


def test_a_full_batch_refuses_another_row(pair):
    batch = pair.target.new_batch(1)
    batch.new_sequence()
    with pytest.raises(Exception, match="full"):
        batch.new_sequence()


# ---- the scheduler: exactness -----------------------------------------------------------------------


def batch_outputs(scheduler, prompts, cfgs, stagger=False):
    """Run the prompts through the scheduler, each read on its own thread; with `stagger`, request i is
    sent only after request i-1 has produced tokens, so requests join a batch already running."""
    outputs, stats = [None] * len(prompts), [SpecStats() for _ in prompts]
    started = [threading.Event() for _ in prompts]

    def read(i):
        if stagger and i:
            started[i - 1].wait(30)
        tokens = []
        try:
            for step in scheduler.decode(prompts[i], cfgs[i], stats[i]):
                tokens += step
                started[i].set()
            outputs[i] = tokens
        except Exception:  # a failed request leaves None (planted bugs may crash instead of mismatching)
            pass
        finally:
            started[i].set()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return outputs, stats


def alone(deployment, prompt, cfg):
    return sum(deployment.generator.decoder.decode(prompt, cfg, SpecStats()), [])


def scheduler_for(deployment, drafter="model", **kwargs):
    drafter = deployment.drafter if drafter == "model" else NgramDrafter.from_config(NgramConfig())
    return BatchScheduler(deployment.target, drafter, [], deployment.costs, max_batch_size=kwargs.pop("max_batch_size", 4),
                          max_queue=kwargs.pop("max_queue", 32), **kwargs)


MIXED = [
    GenerationConfig(max_new_tokens=30, stop_on_eos=False, draft_length="fixed", num_draft_tokens=3),
    GenerationConfig(max_new_tokens=25, stop_on_eos=False),  # adaptive: the planner decides
    GenerationConfig(max_new_tokens=40, stop_on_eos=False, speculative=False),
    GenerationConfig(max_new_tokens=20, stop_on_eos=False, draft_length="fixed", num_draft_tokens=1),
    GenerationConfig(max_new_tokens=35, stop_on_eos=False, speculative=False),
    GenerationConfig(max_new_tokens=30, stop_on_eos=False, draft_length="fixed", num_draft_tokens=5),
]


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_every_request_in_a_batch_decodes_as_it_would_alone(pair, drafter):
    """Six requests, four slots: requests queue, join mid-flight with other prompt lengths and K, leave."""
    prompts = prompts_of([5, 40, 3, 17, 9, 60])
    scheduler = scheduler_for(pair, drafter, prefill_chunk=16)
    outputs, stats = batch_outputs(scheduler, prompts, MIXED, stagger=True)
    single = scheduler_for(pair, drafter, max_batch_size=1)  # the same requests one at a time
    for prompt, cfg, out in zip(prompts, MIXED, outputs):
        reference = sum(single.decode(prompt, cfg, SpecStats()), [])
        assert len(out) == cfg.max_new_tokens
        assert_greedy_equivalent(pair, prompt, out, reference)
        assert_greedy_equivalent(pair, prompt, out, alone(pair, prompt, cfg.model_copy(update={"speculative": False})))
    assert sum(s.drafted for s in stats) > 0  # some rows speculated while others decoded in the batched call


def test_eos_stop_and_cancel_free_their_rows(pair):
    scheduler = scheduler_for(pair, max_batch_size=2)
    prompt = prompts_of([6, 6])[0]
    cfg = GenerationConfig(max_new_tokens=50, stop_on_eos=False, speculative=False)
    reference = alone(pair, prompt, cfg)
    stop_at = reference[4]
    stream = scheduler.decode(prompt, cfg, SpecStats())
    next(stream)
    stream.close()  # a reader that stops (stop string, client gone) cancels the request
    eos_cfg = cfg.model_copy(update={"stop_on_eos": True})
    out = sum(scheduler.decode(prompt, eos_cfg, SpecStats(), eos_token_ids=[stop_at]), [])
    assert out == reference[: reference.index(stop_at) + 1]
    outs, _ = batch_outputs(scheduler, [prompt, prompt], [cfg, cfg])
    assert outs == [reference, reference]  # both slots came back
    assert scheduler.running == [] and len(scheduler.batch.rows) == 0


def test_a_request_beyond_the_queue_is_refused_at_once(pair):
    scheduler = scheduler_for(pair, max_batch_size=1, max_queue=1)
    cfg = GenerationConfig(max_new_tokens=200, stop_on_eos=False, speculative=False)
    with scheduler._wake:  # hold the scheduler so nothing finishes while we fill it
        first = scheduler.decode([5, 6, 7], cfg, SpecStats())
        second = scheduler.decode([5, 6, 7], cfg, SpecStats())
        with pytest.raises(ServerBusyError, match="max_batch_size 1, max_queue 1"):
            scheduler.decode([5, 6, 7], cfg, SpecStats())
    first.close(), second.close()


# ---- planted batching bugs must fail ----------------------------------------------------------------


def _equivalence_holds(pair, scheduler_kwargs=None):
    prompts = prompts_of([5, 40, 3, 17])
    cfgs = [c.model_copy(update={"speculative": False}) for c in MIXED[:4]]
    outputs, _ = batch_outputs(scheduler_for(pair, **(scheduler_kwargs or {})), prompts, cfgs, stagger=True)
    try:
        for prompt, cfg, out in zip(prompts, cfgs, outputs):
            assert_greedy_equivalent(pair, prompt, out, alone(pair, prompt, cfg))
    except AssertionError:
        return False
    return True


def test_planted_bug_rows_getting_each_others_logits_fails(pair, monkeypatch):
    assert _equivalence_holds(pair)
    original = KVBatch.decode

    def swapped(self, rows, token_ids):
        logits = original(self, rows, token_ids)
        return logits[::-1] if len(rows) > 1 else logits  # row i's logits judge row n-1-i's tokens

    monkeypatch.setattr(KVBatch, "decode", swapped)
    assert not _equivalence_holds(pair)


def test_planted_bug_releasing_a_row_without_moving_the_last_one_fails(pair, monkeypatch):
    def release_without_move(self, row):
        slot = self.rows.index(row)
        last = self.rows.pop()
        if last is not row:
            last.slot = slot  # the moved row now reads another request's keys and values
            self.rows[slot] = last
        row.slot = -1

    monkeypatch.setattr(KVBatch, "release", release_without_move)
    assert not _equivalence_holds(pair)


def test_planted_bug_rolling_back_the_wrong_row_fails(pair, monkeypatch):
    """The rollback after a rejection hits the next request's row instead of the rejecting one."""
    from specpipe.engines.base import EngineSequence

    original = EngineSequence.truncate
    rows_seen = []

    def truncate_wrong_row(self, length):
        batch = getattr(self, "batch", None)
        if batch is not None and len(batch.rows) > 1 and len(self) - length >= 1:
            other = batch.rows[(batch.rows.index(self) + 1) % len(batch.rows)]
            rows_seen.append(other)
            return original(other, min(length, len(other)))
        return original(self, length)

    monkeypatch.setattr(EngineSequence, "truncate", truncate_wrong_row)
    prompts = prompts_of([5, 40, 3, 17])
    cfgs = MIXED[:4]
    outputs, _ = batch_outputs(scheduler_for(pair, "ngram"), prompts, cfgs, stagger=True)
    monkeypatch.undo()
    assert rows_seen
    caught = []
    for prompt, cfg, out in zip(prompts, cfgs, outputs):
        if out is None or len(out) != cfg.max_new_tokens:
            caught.append("failed")  # the request errored or ended early
            continue
        try:
            assert_greedy_equivalent(pair, prompt, out, alone(pair, prompt, cfg))
        except AssertionError:
            caught.append("mismatch")
    assert caught


# ---- sampling inside a batch ------------------------------------------------------------------------


def batched_first_two(deployment, cfg, n):
    """The first two tokens of n seeded requests, all sent at once: each runs inside a batch of others."""
    scheduler = scheduler_for(deployment, max_batch_size=8, max_queue=n)
    streams = [scheduler.decode(CONTEXT, cfg.model_copy(update={"seed": seed}), SpecStats()) for seed in range(n)]
    return [first_two_tokens(stream) for stream in streams]


@pytest.mark.parametrize("speculative", [True, False])
def test_sampling_inside_a_batch_matches_the_target_distribution(pair, speculative):
    cfg = SAMPLED.model_copy(update={"speculative": speculative})
    pairs = batched_first_two(pair, cfg, 6000)
    firsts = [a for a, _ in pairs]
    p_first = chi_square_pvalue(dict(zip(*np.unique(firsts, return_counts=True))), target_probs(pair, CONTEXT, cfg.sampling))
    top = max(set(firsts), key=firsts.count)
    seconds = [b for a, b in pairs if a == top]
    p_second = chi_square_pvalue(dict(zip(*np.unique(seconds, return_counts=True))),
                                 target_probs(pair, CONTEXT + [top], cfg.sampling))
    assert len(seconds) > 300
    assert p_first > 0.001 and p_second > 0.001


# ---- load-aware K -----------------------------------------------------------------------------------


COSTS = StepCosts(draft=0.05, verify_per_token=0.04)
BATCHED = BatchCosts({1: 30.0, 2: 32.0, 4: 38.0, 8: 52.0, 16: 90.0})


def test_a_request_alone_speculates_and_a_full_batch_does_not():
    assert plan_batch_draft_lengths([0.6], [3], COSTS, BATCHED) == [3]
    assert plan_batch_draft_lengths([0.6] * 16, [3] * 16, COSTS, BATCHED) == [0] * 16


def test_the_plan_keeps_speculation_for_requests_whose_drafts_pay():
    ks = plan_batch_draft_lengths([0.98, 0.1], [8, 2], COSTS, BatchCosts({1: 30.0, 2: 32.0}))
    assert ks == [8, 0]  # near-certain drafts earn their own call; a poor one decodes in the batch


def test_without_batched_calls_speculation_is_judged_per_request():
    ks = plan_batch_draft_lengths([0.6] * 8, [3] * 8, COSTS, BatchCosts.unbatched(30.0))
    assert ks == [3] * 8


def test_batch_costs_interpolate_and_extrapolate():
    assert BATCHED.decode(12) == pytest.approx(71.0)
    assert BATCHED.decode(32) == pytest.approx(90 + 16 * (90 - 52) / 8)
    assert BatchCosts.from_dict(BATCHED.as_dict()) == BATCHED


def test_a_user_schedule_overrides_the_plan(pair):
    schedule = parse_draft_schedule("1:4,3:2,8:0")
    assert [scheduled_draft_length(schedule, n) for n in (1, 2, 3, 4, 9)] == [4, 2, 2, 0, 0]
    for bad in ("4", "2:1,1:3", "a:1", "0:2"):
        with pytest.raises(ValueError):
            parse_draft_schedule(bad)
    scheduler = make_scheduler(pair.target, pair.drafter, [], pair.costs, pair.manifest.model_copy(
        update={"serving": ServingRecord(max_batch_size=4, draft_schedule="1:3,8:0")}))
    prompts = prompts_of([5, 40, 3, 17])
    cfg = GenerationConfig(max_new_tokens=20, stop_on_eos=False)
    _, stats = batch_outputs(scheduler, prompts[:1], [cfg])
    assert stats[0].drafted > 0  # alone: K = 3
    scheduler = make_scheduler(pair.target, pair.drafter, [], pair.costs, pair.manifest.model_copy(
        update={"serving": ServingRecord(max_batch_size=4, draft_schedule="1:0")}))
    _, stats = batch_outputs(scheduler, prompts[:1], [cfg])
    assert stats[0].drafted == 0


def test_requests_start_from_the_builds_measured_acceptance(pair):
    """A request's acceptance estimate starts at the build's measurement, so a batch does not speculate on an
    uninformed 0.5 for a draft the build saw rejected (the planner then decodes it in the batched call)."""
    from specpipe.speculative.adaptive import ExpectedSpeedupDraftLength

    low, high = (ExpectedSpeedupDraftLength(COSTS, start=4, max_len=8) for _ in range(2))
    low.start_from(0.05), high.start_from(0.95)
    assert low.acceptance < 0.25 < 0.75 < high.acceptance and low.k < high.k
    assert plan_batch_draft_lengths([low.acceptance] * 2, [low.k] * 2, COSTS, BATCHED) == [0] * 2
    assert plan_batch_draft_lengths([high.acceptance] * 2, [high.k] * 2, COSTS, BATCHED) == [high.k] * 2

    scheduler = scheduler_for(pair, prior_acceptance=0.05)
    cfg = GenerationConfig(max_new_tokens=8, stop_on_eos=False)
    with scheduler._wake:  # admit by hand before the scheduler thread steps
        stream = scheduler.decode([5, 6, 7], cfg, SpecStats())
        scheduler._admit()
        assert scheduler.running[0].draft_len.acceptance == pytest.approx(low.acceptance)
    stream.close()
