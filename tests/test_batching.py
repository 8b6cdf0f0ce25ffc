"""Continuous batching: the shared-KV engine, the scheduler's exactness, batched drafting, planted batching bugs,
load-aware K."""

import threading
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from specpipe.contract.costs import BatchCosts, StepCosts
from specpipe.contract.decoding import parse_draft_schedule
from specpipe.contract.drafts import NgramConfig
from specpipe.contract.generation import GenerationConfig, SamplingConfig
from specpipe.contract.manifest import ServingRecord
from specpipe.deployment import load_deployment, make_scheduler
from specpipe.engines.shared_kv import KVBatch, SharedKVEngine
from specpipe.errors import EngineError
from specpipe.speculative import SpecStats
from specpipe.speculative.adaptive import plan_batch_draft_lengths, scheduled_draft_length
from specpipe.speculative.batching import BatchScheduler, ServerBusyError, StepTrace
from specpipe.speculative.drafters import Proposal
from specpipe.speculative.ngram import NgramDrafter
from specpipe.testing.greedy import assert_greedy_equivalent

from tests.test_decoding import CONTEXT, SAMPLED, chi_square_pvalue, first_two_tokens, target_probs


@pytest.fixture(scope="module")
def batch_build(tiny_target, tiny_dir, tiny_tokenizer, tiny_engines_dir):
    """tiny_target with an unrelated 1-layer draft whose head_dim (16) the builder's GroupQueryAttention takes
    (tiny_draft's 8 it refuses): both engines are shared-KV, so the draft's steps batch too."""
    from specpipe.builder import build
    from specpipe.builder.config import BuildConfig
    from specpipe.testing.tiny import make_tiny_llama

    draft = make_tiny_llama(tiny_dir / "draft_hd16", seed=1, num_layers=1, hidden_size=64, tokenizer=tiny_tokenizer)
    return build(BuildConfig(target=str(tiny_target), draft=str(draft), name="pair-batched",
                             engines_dir=tiny_engines_dir, repo_dir=None))


@pytest.fixture(scope="module")
def pair(batch_build):
    return load_deployment(batch_build, threads=1)


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


def test_build_makes_a_llama_draft_a_shared_kv_engine_too(pair):
    assert isinstance(pair.drafter.engine, SharedKVEngine)
    assert pair.manifest.draft.engine.graph == "genai"
    costs = pair.manifest.draft_batch_costs
    assert set(costs.decode_ms) >= {1, 2, 16}
    assert isinstance(pair.drafter.for_batch(4).rows, KVBatch)


def test_a_draft_the_builder_cannot_take_is_exported_with_optimum_and_says_why():
    from types import SimpleNamespace

    from specpipe.builder.config import BuildConfig
    from specpipe.builder.cpu import draft_graph

    cfg = BuildConfig(target="t", draft="d")
    llama = SimpleNamespace(model_type="llama", head_dim=64)
    assert draft_graph(cfg, llama, "genai") == ("genai", None)
    assert draft_graph(cfg, llama, "optimum") == ("optimum", None)  # the draft follows the target's graph
    assert "head_dim 8" in draft_graph(cfg, SimpleNamespace(model_type="llama", head_dim=8), "genai")[1]
    assert "gpt2" in draft_graph(cfg, SimpleNamespace(model_type="gpt2", head_dim=64), "genai")[1]
    calibrated = cfg.model_copy(update={"draft_quant": cfg.draft_quant.model_copy(update={"mode": "int8"})})
    assert "quant int8" in draft_graph(calibrated, llama, "genai")[1]


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


def test_new_rows_prompts_prefill_together_as_torch_does(pair, torch_target):
    """Whole prompts of different lengths in one first-prompt call (right padding); each row's last logits and
    its next decode match torch; a row already running keeps its cache."""
    batch = pair.target.new_batch(4)
    running = batch.new_sequence()
    running.append([5, 6, 7])
    prompts = prompts_of([9, 4, 13])
    rows = [batch.new_sequence() for _ in prompts]
    logits = batch.prefill(rows, prompts)
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(logits[i], torch_logits(torch_target, p)[-1], atol=1e-4)
        assert rows[i].tokens == p
    step = batch.decode([running, *rows], [8, 1, 2, 3])
    np.testing.assert_allclose(step[0], torch_logits(torch_target, [5, 6, 7, 8])[-1], atol=1e-4)
    for i, (p, t) in enumerate(zip(prompts, [1, 2, 3])):
        np.testing.assert_allclose(step[i + 1], torch_logits(torch_target, p + [t])[-1], atol=1e-4)
    with pytest.raises(Exception, match="nothing cached"):
        batch.prefill([running], [[1, 2]])


def test_planted_bug_prefill_reading_the_padded_position_fails(pair, torch_target, monkeypatch):
    """A batched prefill that takes every row's logits at the longest prompt's end (padding) must fail."""
    import specpipe.engines.shared_kv as shared_kv

    original = shared_kv.SharedKVEngine.run

    def padded_end(self, buffers, input_ids, lengths, preempt=None, new_lengths=None, logits_at=None):
        if new_lengths is not None and logits_at is not None:  # every row's logits at the longest prompt's end
            logits_at = np.full_like(logits_at, input_ids.shape[1] - 1)
        return original(self, buffers, input_ids, lengths, preempt, new_lengths, logits_at)

    monkeypatch.setattr(shared_kv.SharedKVEngine, "run", padded_end)
    prompts = prompts_of([9, 4, 13])
    batch = pair.target.new_batch(3)
    logits = batch.prefill([batch.new_sequence() for _ in prompts], prompts)
    with pytest.raises(AssertionError):
        for i, p in enumerate(prompts):
            np.testing.assert_allclose(logits[i], torch_logits(torch_target, p)[-1], atol=1e-4)


@pytest.mark.timing
def test_a_stopped_decode_leaves_every_row_as_it_was(pair, torch_target):
    """Preemption: a request while the call runs stops it (or, asked before, stops the next call as it starts);
    the rows keep their lengths and the same call then gives the same logits. A late or cleared request does not."""
    from specpipe.engines.base import Preempted, Preemption

    batch = pair.target.new_batch(3)
    rows = [batch.new_sequence() for _ in range(3)]
    for row, p in zip(rows, prompts_of([5, 8, 3])):
        row.append(p)
    lengths = [len(r) for r in rows]
    preempt = Preemption(window_s=60.0)
    assert preempt.request() is False and preempt.pending  # nothing runs: kept for the next call
    with pytest.raises(Preempted):
        batch.decode(rows, [1, 2, 3], preempt)
    assert [len(r) for r in rows] == lengths and not preempt.pending
    preempt.request()
    preempt.clear()  # the caller has seen the newcomer: the call runs
    first = batch.decode(rows, [1, 2, 3], preempt)
    assert [len(r) for r in rows] == [n + 1 for n in lengths]
    for row in rows:
        row.truncate(len(row) - 1)

    # Asked once the call is armed: within its window it stops (ONNX Runtime's terminate flag), past it the call
    # finishes. An injected clock states the window rule without racing real time.
    now = [0.0]

    class AskedWhileRunning(Preemption):
        @contextmanager
        def running(self, stop):
            with super().running(stop):
                now[0] += self.elapse
                self.answers.append(self.request())
                yield

    early = AskedWhileRunning(window_s=1.0, clock=lambda: now[0])
    early.elapse, early.answers = 0.5, []
    with pytest.raises(Preempted):
        batch.decode(rows, [1, 2, 3], early)
    assert early.answers == [True] and [len(r) for r in rows] == lengths
    late = AskedWhileRunning(window_s=1.0, clock=lambda: now[0])
    late.elapse, late.answers = 1.5, []
    np.testing.assert_array_equal(batch.decode(rows, [1, 2, 3], late), first)
    assert late.answers == [False]


def _settle_order(scheduler):
    """(request's first prompt token, tokens it has produced, batched steps run) in the order of emission."""
    order, original = [], scheduler._settle

    def settle(request, proposal, logits, **kw):
        original(request, proposal, logits, **kw)
        order.append((request.prompt_ids[0], request.produced, scheduler.steps_run))

    scheduler._settle = settle
    return order


def _newcomer(pair, monkeypatch):
    """Requests A and B are queued together (the scheduler sees both at once: one prefill gives both their first
    token, and they join the batched steps one step apart); request C arrives exactly as the first batched
    decode of both rows is about to run: an arrival point the test sets, not a race between threads.
    Asserts every output equals its batch-1 output; returns the emission order as (request, tokens it has
    produced) and the preemptions."""
    scheduler = scheduler_for(pair, max_batch_size=4)
    cfg = GenerationConfig(max_new_tokens=12, stop_on_eos=False, speculative=False)
    prompts = [[11, *prompts_of([6, 6])[0]], [12, *prompts_of([6, 6])[1][:5]], [13, 5, 9, 44]]
    order = _settle_order(scheduler)
    streams = {}
    original = KVBatch.decode

    def decode_while_a_request_arrives(self, rows, token_ids, preempt=None):
        if len(rows) == 2 and 2 not in streams:
            streams[2] = scheduler.decode(prompts[2], cfg, SpecStats())  # C arrives during this call
        return original(self, rows, token_ids, preempt)

    monkeypatch.setattr(KVBatch, "decode", decode_while_a_request_arrives)
    with scheduler._wake:  # the scheduler's thread waits for this lock: it admits A and B together
        streams[0], streams[1] = (scheduler.decode(p, cfg, SpecStats()) for p in prompts[:2])
    outputs = [sum(streams[i], []) for i in range(3)]
    for prompt, out in zip(prompts, outputs):
        assert_greedy_equivalent(pair, prompt, out, alone(pair, prompt, cfg))
    names = {11: "A", 12: "B", 13: "C"}
    return [(names[who], n) for who, n, _ in order], scheduler.preemptions


@pytest.mark.timing
def test_a_newcomer_stops_the_running_decode_and_gets_its_first_token_first(pair, monkeypatch):
    """The rule: a request arriving while a batched decode runs stops that decode; the newcomer's prompt runs
    and its first token comes before any running request's next token. Every output equals its batch-1 output."""
    order, preemptions = _newcomer(pair, monkeypatch)
    # A's second token is the batched step A runs alone (B joins one step later); C arrives in the next one.
    assert order[:5] == [("A", 1), ("B", 1), ("A", 2), ("C", 1), ("A", 3)], order
    assert preemptions == 1


@pytest.mark.timing
def test_planted_bug_a_newcomer_that_does_not_stop_the_decode_fails(pair, monkeypatch):
    """If a request could not stop the running call, A's third token and B's second would come first."""
    from specpipe.engines.base import Preemption

    monkeypatch.setattr(Preemption, "request", lambda self: False)
    order, preemptions = _newcomer(pair, monkeypatch)
    assert order[:5] == [("A", 1), ("B", 1), ("A", 2), ("A", 3), ("B", 2)], order
    assert preemptions == 0


def test_planted_bug_a_stopped_decode_that_keeps_its_tokens_fails(pair, monkeypatch):
    """If a stopped call had already advanced its rows, the retried step would feed each token twice."""
    from specpipe.engines.base import Preempted

    original = KVBatch.decode
    calls = []

    def advance_then_stop(self, rows, token_ids, preempt=None):
        if preempt is not None and len(rows) > 1 and len(calls) % 3 == 0:
            calls.append(1)
            for row, token in zip(rows, token_ids):
                row.tokens.append(int(token))  # the bug: rows advanced by a call that did not finish
            raise Preempted()
        calls.append(0)
        return original(self, rows, token_ids, preempt)

    monkeypatch.setattr(KVBatch, "decode", advance_then_stop)
    assert not _equivalence_holds(pair)
    assert sum(calls) > 0


def _start_together(pair):
    """Four requests that wait together (one prefill call gives all four their first tokens): the batched step in
    which each got its second token and its last, and whether every output equals its batch-1 output."""
    scheduler = scheduler_for(pair, max_batch_size=4)
    cfg = GenerationConfig(max_new_tokens=10, stop_on_eos=False, speculative=False)
    prompts = [[20 + i, *p] for i, p in enumerate(prompts_of([4, 7, 5, 6]))]
    order = _settle_order(scheduler)
    with scheduler._wake:  # the scheduler sees all four at once
        streams = [scheduler.decode(p, cfg, SpecStats()) for p in prompts]
    outputs = [sum(stream, []) for stream in streams]
    step_of = {(who, n): step for who, n, step in order}
    assert {step_of[(p[0], 1)] for p in prompts} == {0}  # the prefill, before any batched step
    exact = True
    for prompt, out in zip(prompts, outputs):
        try:
            assert_greedy_equivalent(pair, prompt, out, alone(pair, prompt, cfg))
        except AssertionError:
            exact = False
    return [step_of[(p[0], 2)] for p in prompts], [step_of[(p[0], cfg.max_new_tokens)] for p in prompts], exact


@pytest.mark.timing
def test_requests_that_start_together_join_the_batch_one_step_apart(pair):
    """...so they end in four different steps, and their users' next requests do not arrive together."""
    seconds, lasts, exact = _start_together(pair)
    assert sorted(seconds) == [1, 2, 3, 4] and len(set(lasts)) == 4 and exact


@pytest.mark.timing
def test_planted_bug_requests_that_start_together_join_together_fails(pair, monkeypatch):
    def join_at_once(self, request, logits, target_s):
        request.joins = self._steps_done + 1
        self._settle(request, Proposal.empty(), logits, draft_s=0.0, target_s=target_s)

    monkeypatch.setattr(BatchScheduler, "_started", join_at_once)
    seconds, lasts, exact = _start_together(pair)
    assert exact and len(set(lasts)) == 1  # the same tokens, but all four end in one step: the test above fails


def _calls(trace):
    return [(kind, rows, tokens) for kind, rows, tokens, _, _ in trace.calls]


@pytest.mark.timing
def test_a_burst_prefilled_alone_makes_the_calls_a_served_burst_makes(pair):
    """`prefill_alone` (the burst criterion's other side, bench/load_alone.py) runs the loop's own prefill phase: six
    prompts waiting at once for four rows, 20 tokens a step, give the same calls served as alone (whole prompts
    together, a chunk, the last two admitted as rows free up); after it every row is free and the scheduler serves."""
    cfg = GenerationConfig(max_new_tokens=1, stop_on_eos=False, speculative=False)
    prompts = [[20 + i, *p] for i, p in enumerate(prompts_of([8, 6, 7, 5, 8, 4]))]
    served = scheduler_for(pair, max_batch_size=4, prefill_chunk=20)
    served.trace = StepTrace()
    with served._wake:  # the scheduler sees all six at once
        streams = [served.decode(p, cfg, SpecStats()) for p in prompts]
    first_tokens = [sum(stream, []) for stream in streams]
    measured = scheduler_for(pair, max_batch_size=4, prefill_chunk=20)
    calls = _calls(measured.prefill_alone([(p, cfg) for p in prompts]))
    assert calls == _calls(served.trace)
    assert {kind for kind, _, _ in calls} == {"prefill", "prefill-chunk"} and len(calls) >= 3
    assert sum(tokens for _, _, tokens in calls) == sum(map(len, prompts))
    assert not measured.running and not measured.waiting and measured.trace is None
    longer = GenerationConfig(max_new_tokens=6, stop_on_eos=False, speculative=False)
    with measured._wake:  # all four rows are free again, and the outputs are each request's own
        streams = [measured.decode(p, longer, SpecStats()) for p in prompts[:4]]
    for prompt, stream, first in zip(prompts, streams, first_tokens):
        out = sum(stream, [])
        assert out[:1] == first
        assert_greedy_equivalent(pair, prompt, out, alone(pair, prompt, longer))


def test_a_prompt_that_fits_one_call_waits_for_the_next_call_whole_rather_than_split(pair):
    """20 tokens a step: two 9-token prompts go together, the third in the next call, whole (it was chunked: 2
    tokens with the first call's leftover budget, alone, then 7 more alone: 3 calls for 27 tokens became 2)."""
    cfg = GenerationConfig(max_new_tokens=1, stop_on_eos=False, speculative=False)
    prompts = [[20 + i, *p] for i, p in enumerate(prompts_of([8, 8, 8]))]
    prompts[1] = prompts[1][:9]
    measured = scheduler_for(pair, max_batch_size=4, prefill_chunk=20)
    assert _calls(measured.prefill_alone([(p, cfg) for p in prompts])) == [("prefill", 2, 18), ("prefill", 1, 9)]
    longer = [list(range(3, 3 + 45))]  # longer than a call's budget: chunks, alone
    assert _calls(measured.prefill_alone([(longer[0], cfg)])) == [("prefill-chunk", 1, 20)] * 2 + [("prefill-chunk", 1, 5)]


def test_the_buffer_grows_past_its_first_capacity(pair, torch_target):
    batch = pair.target.new_batch(2)
    rows = [batch.new_sequence() for _ in range(2)]
    long = [int(t) for t in np.random.default_rng(3).integers(3, 300, size=300)]
    rows[0].append([5, 6, 7])
    rows[1].append(long)  # beyond the first 256 tokens of capacity: the buffer doubles, rows keep their cache
    logits = batch.decode(rows, [8, 9])
    np.testing.assert_allclose(logits[0], torch_logits(torch_target, [5, 6, 7, 8])[-1], atol=1e-4)
    np.testing.assert_allclose(logits[1], torch_logits(torch_target, long + [9])[-1], atol=1e-4)


def test_a_row_started_from_a_saved_prefix_continues_as_torch_does(pair, torch_target):
    """save_prefix / load_prefix: a row that starts from another row's first tokens (their keys and values copied,
    into another slot of a batch whose buffer has grown since) runs only what follows and gives the logits of the
    whole sequence; the rows stay apart (the first keeps decoding its own tokens)."""
    batch = pair.target.new_batch(3)
    first, filler, second = batch.new_sequence(), batch.new_sequence(), batch.new_sequence()
    rng = np.random.default_rng(5)
    shared, own = [int(t) for t in rng.integers(3, 300, size=10)], [int(t) for t in rng.integers(3, 300, size=4)]
    first.append(shared + [11, 12])
    prefix = first.save_prefix(len(shared))
    filler.append([int(t) for t in rng.integers(3, 300, size=300)])  # the buffer grows: new arrays
    second.load_prefix(prefix)
    assert second.tokens == shared
    logits = second.append(own)
    np.testing.assert_allclose(logits, torch_logits(torch_target, shared + own)[len(shared):], atol=1e-4)
    both = batch.decode([first, second], [13, 14])
    np.testing.assert_allclose(both[0], torch_logits(torch_target, shared + [11, 12, 13])[-1], atol=1e-4)
    np.testing.assert_allclose(both[1], torch_logits(torch_target, shared + own + [14])[-1], atol=1e-4)
    with pytest.raises(EngineError, match="nothing cached"):
        second.load_prefix(prefix)
    with pytest.raises(ValueError):
        first.save_prefix(0)


def check_kept_bindings(pair, torch_target):
    """Calls go through bindings the batch keeps (engines/shared_kv.py KVBinding): logits returned earlier stay as
    they were after the next call into the same output buffer, and once the buffer grows (new arrays, for another
    row) a row's calls and the batched calls write to the new arrays."""
    batch = pair.target.new_batch(2)
    short, long = batch.new_sequence(), batch.new_sequence()
    rng = np.random.default_rng(4)
    ids, long_ids = [int(t) for t in rng.integers(3, 300, size=12)], [int(t) for t in rng.integers(3, 300, size=300)]
    reference = torch_logits(torch_target, ids)
    short.append(ids[:8])
    steps = [short.append([t]) for t in ids[8:10]]  # one-token calls into one kept output buffer
    long.append(long_ids)  # beyond the first 256 tokens of capacity: the buffer grows
    steps.append(short.append([ids[10]]))
    both = batch.decode([short, long], [ids[11], 7])
    for i, logits in enumerate(steps):
        np.testing.assert_allclose(logits[0], reference[8 + i], atol=1e-4)
    np.testing.assert_allclose(both[0], reference[11], atol=1e-4)
    np.testing.assert_allclose(both[1], torch_logits(torch_target, long_ids + [7])[-1], atol=1e-4)


def test_kept_bindings_give_each_call_its_own_logits_and_follow_a_grown_buffer(pair, torch_target):
    check_kept_bindings(pair, torch_target)


@pytest.mark.parametrize("planted", ["returns the kept buffer", "keeps bindings of the old buffer"])
def test_planted_binding_bugs_fail(pair, torch_target, monkeypatch, planted):
    import specpipe.engines.shared_kv as shared_kv

    if planted == "returns the kept buffer":  # no copy out of the output buffer the next call overwrites
        def forward(self, token_ids, last=None, *, lend=False):
            batch, pad = self.batch, max(0, self.batch.engine.min_rows - len(token_ids))
            batch._reserve(len(self.tokens) + len(token_ids) + pad)
            ids = np.asarray([token_ids + token_ids[-1:] * pad])
            at = np.arange(len(token_ids) - min(last or len(token_ids), len(token_ids)), len(token_ids))[None, :]
            return batch.engine.run(batch._binding(self.slot, 1, False), ids, np.array([len(self.tokens)]), logits_at=at)[0]

        monkeypatch.setattr(shared_kv.SlotSequence, "_forward", forward)
    else:
        grow = shared_kv.KVBatch._grow

        def grow_keeping_bindings(self, capacity):
            kept = getattr(self, "_bindings", {})
            grow(self, capacity)
            self._bindings = kept

        monkeypatch.setattr(shared_kv.KVBatch, "_grow", grow_keeping_bindings)
    with pytest.raises(AssertionError):
        check_kept_bindings(pair, torch_target)


def check_inputs_kept_bound(pair, torch_target):
    """Token ids written into arrays bound once per call shape, the logits index bound once, an all-ones mask as a
    view of kept memory (KVBinding.bind_inputs / bind_row), and lent logits (append_lent): every call's logits are
    still the target's, whatever shape came before it, and the batched masks with rows of equal and of unequal
    lengths are right."""
    rng = np.random.default_rng(11)
    ids = [int(t) for t in rng.integers(3, 300, size=24)]
    reference = torch_logits(torch_target, ids)
    row = pair.target.new_batch(1).new_sequence()
    row.append(ids[:6], last=1)
    at, lent = 6, []
    for size in (1, 1, 3, 1, 2, 2, 1, 3, 1):  # decode steps and verify-sized calls, shapes changing and repeating
        logits = row.append_lent(ids[at : at + size], last=size)
        np.testing.assert_allclose(logits, reference[at : at + size], atol=1e-4)
        lent.append(logits)
        at += size
    assert np.shares_memory(lent[0], lent[1])  # lent: the binding's own buffer, no copy
    kept = row.append(ids[at : at + 1])
    np.testing.assert_allclose(kept, reference[at : at + 1], atol=1e-4)
    row.append_lent(ids[at + 1 : at + 2])
    np.testing.assert_allclose(kept, reference[at : at + 1], atol=1e-4)  # append's copy outlives the next call
    batch = pair.target.new_batch(3)
    rows = batch.new_sequence(), batch.new_sequence(), batch.new_sequence()
    prompts = [[int(t) for t in rng.integers(3, 300, size=n)] for n in (5, 5, 9)]
    batch.prefill(rows, prompts)
    firsts = batch.decode(rows[:2], [7, 8])  # two rows of equal length: the mask of kept ones
    batch.decode(rows[2:], [9])
    mixed = batch.decode(rows, [10, 11, 12])  # unequal lengths: a mask of each row's own
    for i, (prompt, tokens) in enumerate(zip(prompts, ([7, 10], [8, 11], [9, 12]))):
        expected = torch_logits(torch_target, prompt + tokens)
        if i < 2:
            np.testing.assert_allclose(firsts[i], expected[-2], atol=1e-4)
        np.testing.assert_allclose(mixed[i], expected[-1], atol=1e-4)


def test_inputs_stay_bound_and_lent_logits_are_the_targets(pair, torch_target):
    check_inputs_kept_bound(pair, torch_target)


@pytest.mark.parametrize("planted", ["ids bound, not written", "ids bound once for every shape",
                                     "ones for unequal rows", "index rebound never"])
def test_planted_input_binding_bugs_fail(pair, torch_target, monkeypatch, planted):
    import specpipe.engines.shared_kv as shared_kv

    binding = shared_kv.KVBinding
    if planted == "ids bound, not written":
        bind_ids = binding._bind_ids
        monkeypatch.setattr(binding, "_bind_ids", lambda self, token_ids, rows, new: bind_ids(
            self, token_ids if new > shared_kv._KEPT_OUTPUT_TOKENS or (rows, new) not in self._ids else self._ids[(rows, new)],
            rows, new))
    elif planted == "ids bound once for every shape":
        bind_ids = binding._bind_ids

        def once(self, token_ids, rows, new):
            if self._ids_bound != (0, 0) and new <= shared_kv._KEPT_OUTPUT_TOKENS:
                self._ids_bound = (rows, new)
            bind_ids(self, token_ids, rows, new)

        monkeypatch.setattr(binding, "_bind_ids", once)
    elif planted == "ones for unequal rows":
        bind_inputs = binding.bind_inputs
        monkeypatch.setattr(binding, "bind_inputs", lambda self, input_ids, totals, index: bind_inputs(
            self, input_ids, np.full_like(totals, totals.max()), index))
    else:
        bind_index = binding._bind_index

        def never(self, index):
            if self._index_bound is None:
                bind_index(self, index)

        monkeypatch.setattr(binding, "_bind_index", never)
    # A stale index either picks the wrong positions or points past the call's tokens (ONNX Runtime refuses it).
    with pytest.raises(AssertionError if planted != "index rebound never" else (AssertionError, RuntimeError)):
        check_inputs_kept_bound(pair, torch_target)


def check_a_binding_lets_go_of_a_prompts_logits(engine):
    """A kept binding holds the arrays it binds; a prompt's logits (new arrays, not kept) must not stay alive in it."""
    import gc
    import weakref

    buffers = [np.zeros((1, engine.kv_heads, 64, engine.head_dim), engine.kv_dtype) for _ in engine.past_names]
    kv = engine.bind(buffers)
    logits = engine.run(kv, np.arange(3, 43)[None, :], np.array([0]))  # [1, 40, vocab]: more than a binding keeps
    alive = weakref.ref(logits)
    del logits
    gc.collect()
    assert alive() is None
    assert engine.run(kv, np.array([[7]]), np.array([40])).shape == (1, 1, engine.vocab_size)  # and binds anew


def test_a_binding_lets_go_of_a_prompts_logits(pair):
    check_a_binding_lets_go_of_a_prompts_logits(pair.target)


def test_planted_binding_that_holds_a_prompts_logits_fails(pair, monkeypatch):
    import specpipe.engines.shared_kv as shared_kv

    monkeypatch.setattr(shared_kv.KVBinding, "let_go", lambda self: None)
    with pytest.raises(AssertionError):
        check_a_binding_lets_go_of_a_prompts_logits(pair.target)


def test_a_full_batch_refuses_another_row(pair):
    batch = pair.target.new_batch(1)
    batch.new_sequence()
    with pytest.raises(Exception, match="full"):
        batch.new_sequence()


# ---- the scheduler: exactness -----------------------------------------------------------------------


def batch_outputs(scheduler, prompts, cfgs, stagger=False):
    """Run the prompts through the scheduler, each read on its own thread; with `stagger`, request i is
    sent only after request i-1 has produced tokens, so requests join a batch already running.

    The order is the test's, not the threads' timing: after each scheduling step in which a running request has
    produced tokens, the scheduler waits until the next request has been sent. Without that hold a fast engine
    (or a loaded machine) finished request i-1 before request i arrived, the batch never held two rows, and
    the planted-bug tests that need two rows passed their bugs (seen under the CPU hog)."""
    outputs, stats = [None] * len(prompts), [SpecStats() for _ in prompts]
    started = [threading.Event() for _ in prompts]
    sent = [threading.Event() for _ in prompts]
    if stagger:
        step = scheduler.step

        def step_then_hold():
            step()
            waiting = next((i for i, event in enumerate(sent) if not event.is_set()), None)
            if waiting is not None and any(r.produced > 0 for r in scheduler.running):
                sent[waiting].wait(30)

        scheduler.step = step_then_hold

    def read(i):
        if stagger and i:
            started[i - 1].wait(30)
        tokens = []
        try:
            stream = scheduler.decode(prompts[i], cfgs[i], stats[i])
            sent[i].set()
            for step in stream:
                tokens += step
                started[i].set()
            outputs[i] = tokens
        except Exception:  # a failed request leaves None (planted bugs may crash instead of mismatching)
            pass
        finally:
            sent[i].set()
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


@pytest.mark.timing
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


@pytest.mark.timing
def test_eos_stop_and_cancel_free_their_rows(pair):
    scheduler = scheduler_for(pair, max_batch_size=2)
    prompt = prompts_of([6, 6])[0]
    cfg = GenerationConfig(max_new_tokens=50, stop_on_eos=False, speculative=False)
    reference = sum(scheduler.decode(prompt, cfg, SpecStats()), [])  # alone in the scheduler: the same calls as below
    stop_at = reference[4]
    stream = scheduler.decode(prompt, cfg, SpecStats())
    next(stream)
    stream.close()  # a reader that stops (stop string, client gone) cancels the request
    eos_cfg = cfg.model_copy(update={"stop_on_eos": True})
    out = sum(scheduler.decode(prompt, eos_cfg, SpecStats(), eos_token_ids=[stop_at]), [])
    assert out == reference[: reference.index(stop_at) + 1]
    outs, _ = batch_outputs(scheduler, [prompt, prompt], [cfg, cfg])
    for out in outs:  # both slots came back; a 2-row call may round a near-tie differently from a 1-row one
        assert_greedy_equivalent(pair, prompt, out, reference)
    assert scheduler.running == [] and len(scheduler.batch.rows) == 0


@pytest.mark.timing
def test_a_request_beyond_the_queue_is_refused_at_once(pair):
    scheduler = scheduler_for(pair, max_batch_size=1, max_queue=1)
    cfg = GenerationConfig(max_new_tokens=200, stop_on_eos=False, speculative=False)
    with scheduler._wake:  # hold the scheduler so nothing finishes while we fill it
        first = scheduler.decode([5, 6, 7], cfg, SpecStats())
        second = scheduler.decode([5, 6, 7], cfg, SpecStats())
        with pytest.raises(ServerBusyError, match="max_batch_size 1, max_queue 1"):
            scheduler.decode([5, 6, 7], cfg, SpecStats())
    first.close(), second.close()


@pytest.mark.timing
def test_close_ends_the_thread_after_its_engine_call_and_fails_what_is_left(pair):
    """close() (also run at exit for every scheduler left open: a thread left inside ONNX Runtime while the
    interpreter tore it down aborted the process) lets the engine call in progress finish, then ends the thread;
    the running and the queued request each get an error, and new requests are refused."""
    import threading

    scheduler = scheduler_for(pair, drafter="ngram", max_batch_size=1, max_queue=2)
    cfg = GenerationConfig(max_new_tokens=200, stop_on_eos=False, speculative=False)
    inside, release = threading.Event(), threading.Event()
    decode = scheduler.batch.decode

    def held(*args, **kwargs):  # the test decides when the engine call in progress ends
        inside.set()
        assert release.wait(60)
        return decode(*args, **kwargs)

    scheduler.batch.decode = held
    first = scheduler.decode([5, 6, 7], cfg, SpecStats())
    assert next(first)  # its prompt ran; its next step waits inside the engine call
    assert inside.wait(60)
    second = scheduler.decode([5, 6, 7], cfg, SpecStats())  # one row: it queues
    closer = threading.Thread(target=scheduler.close)
    closer.start()
    while not scheduler._closing:  # close() has asked; the engine call is still in progress
        closer.join(0.01)
    assert scheduler._thread.is_alive()
    release.set()
    closer.join(60)
    assert not closer.is_alive() and not scheduler._thread.is_alive()
    for stream in (first, second):
        with pytest.raises(ServerBusyError, match="closed"):
            list(stream)
    assert scheduler.running == [] and not scheduler.waiting and len(scheduler.batch.rows) == 0
    with pytest.raises(ServerBusyError, match="closed"):
        scheduler.decode([5, 6, 7], cfg, SpecStats())


# ---- batched drafting ---------------------------------------------------------------------------------


DRAFT_CFGS = [
    GenerationConfig(seed=1, sampling=SamplingConfig(temperature=0.8, top_p=0.95)),  # adaptive: stops when unsure
    GenerationConfig(seed=2, draft_length="fixed", num_draft_tokens=4),  # fixed: never stops early
    GenerationConfig(seed=3, sampling=SamplingConfig(temperature=1.2, top_k=20)),
    GenerationConfig(seed=4),  # greedy
    GenerationConfig(seed=5, sampling=SamplingConfig(temperature=0.7), draft_length="fixed", num_draft_tokens=4),
]


def _proposals_match(deployment, rounds=8):
    """Five requests drafted by propose_batch and, in parallel, each by its own session's propose, over rounds
    of random K and random acceptance (1 or 2 tokens to catch up, or more after a K = 0 round); one request
    leaves and another joins halfway (a draft row released, the last row moved into its slot). True when every
    proposal matches: the same tokens and the same q."""
    rng = np.random.default_rng(7)
    batched = deployment.drafter.for_batch(len(DRAFT_CFGS))
    cfgs = list(DRAFT_CFGS)
    sessions = [batched.new_request(cfg) for cfg in cfgs]
    alone = [deployment.drafter.new_request(cfg) for cfg in cfgs]
    rngs = [(np.random.default_rng(cfg.seed), np.random.default_rng(cfg.seed)) for cfg in cfgs]
    contexts = prompts_of([5, 40, 3, 17, 9])
    for round_ in range(rounds):
        if round_ == rounds // 2:  # request 0 leaves, a new one joins
            sessions[0].close()
            cfgs[0] = cfgs[0].model_copy(update={"seed": 11})
            sessions[0], alone[0] = batched.new_request(cfgs[0]), deployment.drafter.new_request(cfgs[0])
            rngs[0] = (np.random.default_rng(11), np.random.default_rng(11))
            contexts[0] = prompts_of([5, 12, 3])[2]
        ks = [int(k) for k in rng.integers(0, 6, size=len(cfgs))]
        speculating = [i for i, k in enumerate(ks) if k > 0]  # the scheduler asks only for these
        got = batched.propose_batch([sessions[i] for i in speculating], [contexts[i] for i in speculating],
                                    [ks[i] for i in speculating], [cfgs[i].sampling for i in speculating],
                                    [rngs[i][0] for i in speculating])
        for proposal, i in zip(got, speculating):
            wanted = alone[i].propose(contexts[i], ks[i], cfgs[i].sampling, rngs[i][1])
            if proposal.tokens != wanted.tokens or (proposal.probs is None) != (wanted.probs is None):
                return False
            if proposal.probs is not None and not np.array_equal(proposal.probs, wanted.probs):
                return False
        for i in range(len(cfgs)):  # accept a random prefix, then a recovered or bonus token
            drafted = got[speculating.index(i)].tokens if i in speculating else []
            contexts[i] = contexts[i] + drafted[: int(rng.integers(0, len(drafted) + 1))] + [int(rng.integers(3, 300))]
    return True


def test_propose_batch_gives_each_row_what_it_proposes_alone(pair):
    """Seeded sampling, greedy, fixed and adaptive K, early stops: the same tokens and q, bit for bit (an fp32
    draft scores a row alike alone and in a batched call on this CPU)."""
    assert _proposals_match(pair)


def test_planted_bug_two_rows_draft_logits_swapped_fails(pair, monkeypatch):
    original = KVBatch.decode

    def swapped(self, rows, token_ids, preempt=None):
        logits = original(self, rows, token_ids, preempt)
        if self.engine is pair.drafter.engine and len(rows) > 1:
            logits[[0, 1]] = logits[[1, 0]]  # the first two rows draft from each other's logits
        return logits

    monkeypatch.setattr(KVBatch, "decode", swapped)
    assert not _proposals_match(pair)


def _draft_rows_come_back(pair):
    scheduler = scheduler_for(pair, max_batch_size=2)
    prompts = prompts_of([5, 40, 3, 17, 9, 60])
    cfg = GenerationConfig(max_new_tokens=12, stop_on_eos=False, draft_length="fixed", num_draft_tokens=3)
    outputs, stats = batch_outputs(scheduler, prompts, [cfg] * 6)
    assert all(out is not None and len(out) == 12 for out in outputs)
    assert all(s.drafted > 0 for s in stats)
    assert len(scheduler.drafter.rows.rows) == 0 and len(scheduler.batch.rows) == 0


def test_draft_rows_come_back_when_requests_leave(pair):
    """Six speculating requests through two slots: each leaves its draft row to the next."""
    _draft_rows_come_back(pair)


def test_planted_bug_a_draft_row_never_released_fails(pair, monkeypatch):
    """The third request finds the draft batch full and fails at once (the scheduler serves on)."""
    from specpipe.speculative.drafters import ModelDraftSession

    monkeypatch.setattr(ModelDraftSession, "close", lambda self: None)
    with pytest.raises(AssertionError):
        _draft_rows_come_back(pair)


def test_fixed_k_requests_draft_the_same_in_a_batch_as_alone(pair):
    """With a fixed K a request's steps depend on its own context only, so batched drafting must draft and accept
    exactly what the same request does through a one-slot scheduler (propose per row, never batched)."""
    prompts = prompts_of([5, 40, 3, 17])
    cfgs = [GenerationConfig(max_new_tokens=24, stop_on_eos=False, draft_length="fixed", num_draft_tokens=k, seed=i,
                             sampling=SamplingConfig(temperature=0.9 if i % 2 else 0.0)) for i, k in enumerate([1, 3, 5, 2])]
    _, batched = batch_outputs(scheduler_for(pair, prefill_chunk=16), prompts, cfgs, stagger=True)
    single = scheduler_for(pair, max_batch_size=1)
    for prompt, cfg, stats in zip(prompts, cfgs, batched):
        alone_stats = SpecStats()
        sum(single.decode(prompt, cfg, alone_stats), [])
        assert (stats.drafted_at, stats.accepted_at) == (alone_stats.drafted_at, alone_stats.accepted_at)


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

    def swapped(self, rows, token_ids, preempt=None):
        logits = original(self, rows, token_ids, preempt)
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


def test_batched_drafting_makes_speculation_pay_where_lone_drafting_does_not():
    """Two rows, a costly draft (c = 0.3): drafting alone, each row's 3 draft steps cost 27 ms and decoding both in
    one call wins; drafting together, the 3 steps cost 28 ms for both rows and speculating wins."""
    costs = StepCosts(draft=0.3, verify_per_token=0.04)
    draft_batch = BatchCosts({1: 9.0, 2: 9.4, 4: 10.2, 8: 12.0})
    assert plan_batch_draft_lengths([0.9] * 2, [3] * 2, costs, BATCHED) == [0, 0]
    assert plan_batch_draft_lengths([0.9] * 2, [3] * 2, costs, BATCHED, draft_batch) == [3, 3]


def test_a_manifest_without_draft_batch_costs_plans_as_before(pair):
    from specpipe.drafts import manifest_of

    old = pair.manifest.as_dict()
    del old["draft_batch_costs"]
    manifest = manifest_of(old)
    assert manifest.draft_batch_costs is None
    scheduler = make_scheduler(pair.target, pair.drafter, [], pair.costs, manifest)
    assert scheduler.draft_batch_costs is None
    assert make_scheduler(pair.target, pair.drafter, [], pair.costs, pair.manifest).draft_batch_costs == pair.manifest.draft_batch_costs


def test_batch_costs_interpolate_and_extrapolate():
    assert BATCHED.decode(12) == pytest.approx(71.0)
    assert BATCHED.decode(32) == pytest.approx(90 + 16 * (90 - 52) / 8)
    assert BatchCosts.from_dict(BATCHED.as_dict()) == BATCHED


def test_a_user_schedule_overrides_the_plan(pair):
    schedule = list(parse_draft_schedule("1:4,3:2,8:0").items())
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
