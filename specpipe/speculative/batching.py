"""Continuous batching with speculative decoding: many requests share the target, each speculates or not.

`BatchScheduler.decode()` has the signature of `SpeculativeDecoder.decode()` (token ids in, the tokens of
each step out), so `SpecGenerator`, the Triton model and the benchmarks use either. Requests join the
running batch at any step and leave when done; one thread runs the steps. Each step:

  0. admit waiting requests while there is room and prefill their prompts, `prefill_chunk` tokens a step in
     all: whole prompts in one batched call, a longer one in chunks, alone, so it delays running requests by
     a chunk, not by its whole length. The call with a prompt's last token gives the request's first token.
     New requests go first (time to first token): one that arrives during a batched decode (step 3, when no
     request drafted) stops that call if it is less than half done (`Preemption`: the call's work is lost,
     no row changes), and one that arrives during a prefill is admitted before the next step. A closed-loop
     user's next request arrives just after the step that ended its last one began, and would otherwise
     wait for that whole step before its prompt even starts. Requests whose first tokens came between the
     same two steps then join the batched steps one step apart (`_started`): joined together, they would end
     together, and their users' next requests would again arrive together and queue behind each other;
  1. choose K per request (0 = no speculation): the request's own adaptive K (adaptive.py), then
     `plan_batch_draft_lengths` for the batch (or the user's batch-size -> K table);
  2. draft: each speculating request's drafter proposes up to K tokens x_1..x_K with their q, all in one
     `propose_batch` (a model draft's one-token steps run as batched calls over the rows still drafting;
     prompt lookup runs per row);
  3. verify: requests without drafts append their last token in ONE batched target call; each request
     with drafts runs its own call on [last token, x_1..x_K] (engines/shared_kv.py says why);
  4. accept each x_i with min(1, p/q), resample the first rejection from norm(max(0, p - q)), or add the
     bonus token (settle.py, the step decoder.py also runs), roll the request's cache back to what it accepted, and
     hand the emitted tokens to its reader, who is woken just before the next engine call (`_deliver`).

Each request keeps its own random generator, sampling settings, stop conditions and statistics, and its
tokens are the ones the single-request decoder would produce: a row's logits do not depend on the other
rows in the call (greedy equivalence, tests/test_batching.py).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import numpy as np

from specpipe.contract.costs import BatchCosts, StepCosts
from specpipe.contract.generation import GenerationConfig
from specpipe.engines.base import Engine, Preempted, Preemption
from specpipe.errors import SpecpipeError, UsageError
from specpipe.speculative.adaptive import plan_batch_draft_lengths, scheduled_draft_length
from specpipe.speculative.drafters import Drafter, Proposal
from specpipe.speculative.settle import RequestState, settle
from specpipe.speculative.stats import SpecStats

_DONE = object()  # end of a request's token stream
CLOSE_WAIT_S = 30.0  # how long close() waits for the step in progress (an engine call cannot be stopped half-way)
_LIVE: "weakref.WeakSet[BatchScheduler]" = weakref.WeakSet()  # every scheduler not yet closed, for _close_all


def _close_all() -> None:
    """At exit, stop every scheduler's thread before the interpreter tears the runtimes down. A daemon thread left
    inside ONNX Runtime then is the likely cause (not proven: seen once, no stack) of a process that aborted at exit
    ("terminate called without an active exception", exit -6) in `make test-stress` after every test had passed."""
    for scheduler in list(_LIVE):
        scheduler.close()


atexit.register(_close_all)


class ServerBusyError(UsageError):
    """The batch and its queue are full: the request is refused at once rather than left to wait."""


@dataclass
class _Request(RequestState):
    out: "queue.Queue" = field(default_factory=queue.Queue)
    cancelled: bool = False
    joins: int = 0  # the batched step (a count of steps done) it first takes part in (`_started`)


@dataclass
class StepTrace:
    """What the scheduler thread did, call by call, for a profile (`BatchScheduler.trace`): each engine call's kind,
    rows, tokens and wall-clock span (time.perf_counter). Kinds: "prefill" (whole prompts in one call),
    "prefill-chunk" (part of a long prompt, alone), "decode" (one token for each of `rows` requests), "stopped" (a
    decode stopped for a newcomer: its work is lost), "draft" (a step's drafting), "verify" (one request's drafts)."""

    calls: list[tuple[str, int, int, float, float]] = field(default_factory=list)  # (kind, rows, tokens, t0, t1)
    steps: int = 0  # batched steps that emitted tokens

    def record(self, kind: str, rows: int, tokens: int, t0: float) -> None:
        self.calls.append((kind, rows, tokens, t0, time.perf_counter()))

    def summary(self, window: Optional[tuple[float, float]] = None) -> dict:
        """Per kind: calls, rows, tokens and seconds, over the calls that started inside `window` (perf_counter
        span; all when None); `busy_s` the sum, `span_s` first start to last end."""
        calls = [c for c in self.calls if window is None or window[0] <= c[3] < window[1]]
        kinds: dict[str, dict] = {}
        for kind, rows, tokens, t0, t1 in calls:
            entry = kinds.setdefault(kind, {"calls": 0, "rows": 0, "tokens": 0, "s": 0.0})
            entry["calls"] += 1
            entry["rows"] += rows
            entry["tokens"] += tokens
            entry["s"] += t1 - t0
        span = (max(c[4] for c in calls) - min(c[3] for c in calls)) if calls else 0.0
        return {"kinds": kinds, "busy_s": sum(k["s"] for k in kinds.values()), "span_s": span}


class BatchScheduler:
    def __init__(self, target: Engine, drafter: Optional[Drafter], eos_token_ids: Sequence[int] = (),
                 costs: Optional[StepCosts] = None, *, max_batch_size: int = 8, max_queue: int = 64,
                 batch_costs: Optional[BatchCosts] = None, draft_schedule: Optional[list[tuple[int, int]]] = None,
                 prefill_chunk: int = 256, prior_acceptance: Optional[float] = None,
                 draft_batch_costs: Optional[BatchCosts] = None):
        self.target = target
        self.drafter = drafter.for_batch(max_batch_size) if drafter is not None else None  # a draft row per request
        self.eos_token_ids = set(int(t) for t in eos_token_ids)
        self.costs = costs or (drafter.default_costs() if drafter is not None else StepCosts(0.0, 0.0))
        self.batch_costs = batch_costs or BatchCosts.unbatched()
        self.draft_batch_costs = draft_batch_costs  # None: each row's draft steps cost c each, as if alone
        self.draft_schedule = draft_schedule
        # The draft's acceptance as the build measured it: where each request's estimate starts (adaptive.py).
        self.prior_acceptance = prior_acceptance
        self.max_batch_size, self.max_queue, self.prefill_chunk = max_batch_size, max_queue, prefill_chunk
        self.batch = target.new_batch(max_batch_size)
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.steps_run = 0
        self.preemptions = 0  # batched decodes stopped for a newcomer
        self._preempt = Preemption()
        self._steps_done = 0  # batched steps completed
        self._next_join = 0  # the first step no new request is set to join yet (`_started`)
        self._wake = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self.thread_id: Optional[int] = None
        self.trace: Optional[StepTrace] = None  # set to a StepTrace to record every engine call (a profile)
        self._outbox: list[tuple[queue.Queue, object]] = []  # readers' items, handed over at the next engine call
        self._closing = False
        _LIVE.add(self)

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Stop serving: the thread ends after the step it is in, and every request still queued or running gets an
        error. Requests submitted afterwards are refused."""
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        _LIVE.discard(self)

    def _hand_over(self, request: _Request, item) -> None:
        self._outbox.append((request.out, item))

    def _deliver(self) -> None:
        """Wake the readers of everything settled since the last engine call. Called just before the next call (and
        before the loop waits idle): a woken reader (the Triton model's answering thread detokenizes, builds its
        response and sends it) then runs while ONNX Runtime computes with the GIL released, not beside this thread's
        Python between two calls, which it stretched from 0.9 ms in process to 4 ms served (docs/batching.md)."""
        outbox, self._outbox = self._outbox, []
        for out, item in outbox:
            out.put(item)

    def _traced(self, kind: str, rows: int, tokens: int, t0: float) -> None:
        if self.trace is not None:
            self.trace.record(kind, rows, tokens, t0)

    # ---- the reader's side -------------------------------------------------------------------------

    def decode(self, prompt_ids: Sequence[int], cfg: GenerationConfig, stats: SpecStats,
               eos_token_ids: Optional[Sequence[int]] = None) -> Iterator[list[int]]:
        """Queue a request; iterate for the tokens of each step. Closing the iterator cancels the request."""
        if not prompt_ids:
            raise ValueError("prompt_ids must hold at least one token")
        eos = self.eos_token_ids if eos_token_ids is None else set(int(t) for t in eos_token_ids)
        request = _Request(list(prompt_ids), cfg, stats, eos)
        with self._wake:
            if self._closing:
                raise ServerBusyError("the scheduler is closed: the server is shutting down")
            in_flight = len(self.waiting) + len(self.running)
            if in_flight >= self.max_batch_size + self.max_queue:
                raise ServerBusyError(f"server busy: {len(self.running)} requests running and {len(self.waiting)} "
                                      f"queued (max_batch_size {self.max_batch_size}, max_queue {self.max_queue})")
            self.waiting.append(request)
            self._start()
            self._wake.notify()
            if len(self.running) < self.max_batch_size:  # there is a row for it: its prompt goes first
                self._preempt.request()
        return self._stream(request)

    def _stream(self, request: _Request) -> Iterator[list[int]]:
        try:
            while True:
                item = request.out.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            request.cancelled = True  # a reader that stops early (stop string, client gone) frees the row

    def prefill_alone(self, requests: Sequence[tuple[Sequence[int], GenerationConfig]]) -> StepTrace:
        """The prefill a burst of these requests (prompt ids, settings) costs on this scheduler with nothing else
        running: all waiting at once, admitted and prefilled by the loop's own phase 0 (`_admit`, `_prefill`: its
        prompts-per-call rule and `prefill_chunk`), no decode step between; each request stops at its first token
        and its row is released. For a scheduler that serves nothing (bench/load_alone.py measures a served burst
        against it). Returns the engine calls' trace."""
        if self.running or self.waiting or (self._thread is not None and self._thread.is_alive()):
            raise RuntimeError("prefill_alone() needs a scheduler that serves nothing")
        kept_trace, kept_join = self.trace, self._next_join
        self.trace = StepTrace()
        try:
            for prompt_ids, cfg in requests:
                first_only = cfg.model_copy(update={"max_new_tokens": 1})
                self.waiting.append(_Request(list(prompt_ids), first_only, SpecStats(), self.eos_token_ids))
            while self.waiting or self.running:
                self._admit()
                self._prefill()
            return self.trace
        finally:
            for request in list(self.running):
                self._finish(request)
            self.waiting.clear()
            self._deliver()
            self.trace, self._next_join = kept_trace, kept_join

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="specpipe-batch", daemon=True)
            self._thread.start()

    # ---- the scheduler's side ----------------------------------------------------------------------

    def _loop(self) -> None:
        self.thread_id = threading.get_native_id()  # the kernel's id: a profile reads this thread's CPU time
        while True:
            with self._wake:
                while not self.waiting and not self.running and not self._closing:
                    self._deliver()
                    self._wake.wait()
                if self._closing:
                    for request in [*self.running, *self.waiting]:
                        self._fail(request, ServerBusyError("the scheduler was closed: the server is shutting down"))
                    self.waiting.clear()
                    self._deliver()
                    return
                self._admit()
            try:
                self.step()
            except Exception as err:  # fail every running request, keep serving new ones
                for request in list(self.running):
                    self._fail(request, err)
                self._deliver()

    def _admit(self) -> None:
        self._preempt.clear()  # the loop has seen every request waiting now
        while self.waiting and len(self.running) < self.max_batch_size:
            request = self.waiting.popleft()
            if request.cancelled:
                continue
            try:
                self._open(request)
            except Exception as err:  # a request that cannot start fails alone; the scheduler serves on
                self._fail(request, err)
                continue
            self.running.append(request)

    def _open(self, request: _Request) -> None:
        """Give an admitted request its target row, its draft session (a draft row when batched) and its K policy."""
        request.start(self.batch.new_sequence(), self.drafter, self.costs, self.target.max_seq_len)
        if self.prior_acceptance is not None and hasattr(request.draft_len, "start_from"):
            request.draft_len.start_from(self.prior_acceptance)

    def step(self) -> None:
        """One scheduling step over the running requests (module docstring, phases 0-4)."""
        for request in [r for r in self.running if r.cancelled]:
            self._finish(request)
        started = [r for r in self.running if r.produced > 0]  # requests past their prompt
        if started and all(r.joins > self._steps_done for r in started):
            self._steps_done = min(r.joins for r in started)  # nobody to wait behind: the first joins now
        ready = [r for r in started if r.joins <= self._steps_done]
        self._prefill()
        if not ready or self._give_way():
            return

        # 1. How many tokens each request drafts.
        ks = self._draft_lengths(ready)

        # 2. Draft, all speculating requests together.
        if any(ks):
            self._deliver()
        t0 = time.perf_counter()
        proposals = self._propose(ready, ks)
        t1 = time.perf_counter()
        if any(ks):
            self._traced("draft", sum(k > 0 for k in ks), sum(len(p.tokens) for p in proposals), t0)

        # 3. Verify: one batched call for the requests without drafts, one call each for the others.
        decoding = [i for i, p in enumerate(proposals) if not p.tokens]
        target_logits: list[Optional[np.ndarray]] = [None] * len(ready)
        if len(decoding) == len(ready) and self._give_way():  # one arrived while this step was planned
            return
        if decoding:
            try:
                logits = self._decode([ready[i] for i in decoding], preemptible=len(decoding) == len(ready))
            except Preempted:  # nothing changed: the newcomer's prompt runs, then this step again
                return
            for j, i in enumerate(decoding):
                target_logits[i] = logits[j : j + 1]  # [1, vocab]
        for i, proposal in enumerate(proposals):
            if proposal.tokens:
                self._deliver()
                tv = time.perf_counter()
                target_logits[i] = ready[i].row.append([ready[i].context[-1], *proposal.tokens])  # [K+1, vocab]
                self._traced("verify", 1, len(proposal.tokens) + 1, tv)
        for request in ready:
            request.features_from = len(request.context) - 1  # this step's call ran from the last context token
        t2 = time.perf_counter()

        self.steps_run += 1
        self._steps_done += 1
        if self.trace is not None:
            self.trace.steps += 1

        # 4. Accept or resample; emit; roll each cache back to its accepted tokens.
        for request, proposal, logits in zip(ready, proposals, target_logits):
            self._settle(request, proposal, logits, draft_s=t1 - t0, target_s=t2 - t1)

    def _decode(self, requests: list[_Request], preemptible: bool) -> np.ndarray:
        """One batched call appending each request's last token: logits [len(requests), vocab]. Preemptible only
        when no request drafted this step (drafts already made would be lost). Running requests cannot starve:
        each stop admits a request into a free row, and there are at most max_batch_size of them."""
        preempt = self._preempt if preemptible else None
        self._deliver()
        t0 = time.perf_counter()
        try:
            logits = self.batch.decode([r.row for r in requests], [r.context[-1] for r in requests], preempt)
        except Preempted:
            self.preemptions += 1
            self._traced("stopped", len(requests), 0, t0)
            raise
        self._traced("decode", len(requests), len(requests), t0)
        self._preempt.window_s = (time.perf_counter() - t0) / 2  # stop a call only while it is less than half done
        return logits

    def _give_way(self) -> bool:
        """True when requests that could be admitted are waiting (they arrived during a prefill): the loop
        admits and prefills them before the batched step."""
        with self._wake:
            return bool(self.waiting) and len(self.running) < self.max_batch_size

    def _propose(self, ready: list[_Request], ks: list[int]) -> list[Proposal]:
        """Each request's proposal for this step: empty where K = 0, the drafter's `propose_batch` for the rest."""
        proposals = [Proposal.empty() for _ in ready]
        speculating = [i for i, k in enumerate(ks) if k > 0]
        if speculating:
            drafted = self.drafter.propose_batch([ready[i].draft for i in speculating], [ready[i].context for i in speculating],
                                                 [ks[i] for i in speculating], [ready[i].cfg.sampling for i in speculating],
                                                 [ready[i].rng for i in speculating])
            for i, proposal in zip(speculating, drafted):
                proposals[i] = proposal
        return proposals

    def _settle(self, request: _Request, proposal: Proposal, target_logits: np.ndarray, *, draft_s: float,
                target_s: float) -> None:
        """Judge one request's step and hand its emitted tokens to its reader (settle.py); its cache then holds
        the new context but its last token, which the next step feeds."""
        self._hand_over(request, settle(request, proposal, target_logits, draft_s=draft_s, target_s=target_s))
        if request.finished:
            self._finish(request)

    def _prefill(self) -> None:
        """Feed new requests' prompts into their rows, `prefill_chunk` tokens a step in all: whole prompts that fit
        in one batched call (`EngineBatch.prefill`), a prompt longer than `prefill_chunk` in chunks, alone. A prompt
        that fits a call but not what is left of this step's waits for the next step's call, whole: a chunk of it
        now would be one more call (a burst of 16 ~18-token prompts took 4 calls, 2 of them single-row ones). The
        call that takes a prompt's last token also gives the request's first token (a target-only step), at once.
        Requests whose first tokens come between the same two steps join the batched steps one step apart
        (module docstring)."""
        budget = self.prefill_chunk
        new = [r for r in self.running if r.produced == 0]
        whole, taken = [], 0
        for request in new:
            if len(request.row) == 0 and taken + len(request.context) <= budget:
                whole.append(request)
                taken += len(request.context)
        chunked = [r for r in new if r not in whole and (len(r.row) or len(r.context) > self.prefill_chunk)]
        if whole:
            self._deliver()
            t0 = time.perf_counter()
            logits = self.batch.prefill([r.row for r in whole], [r.context for r in whole])
            self._traced("prefill", len(whole), taken, t0)
            for i, request in enumerate(whole):
                request.features_from = 0
                self._started(request, logits[i : i + 1], time.perf_counter() - t0)
            budget -= taken
        for request in chunked:
            if budget <= 0:
                break
            start = len(request.row)
            take = min(len(request.context) - start, budget)
            self._deliver()
            t0 = time.perf_counter()
            logits = request.row.append(request.context[start : start + take], last=1)
            self._traced("prefill-chunk", 1, take, t0)
            budget -= take
            request.features_from = start
            if start + take == len(request.context):
                self._started(request, logits[-1:], time.perf_counter() - t0)
            else:
                request.observe_features(start + take)

    def _started(self, request: _Request, logits: np.ndarray, target_s: float) -> None:
        """A request's first token, from its prompt's last logits [1, vocab]. It joins the batched steps at the
        next one that no other new request joins: requests that joined together would advance together and end
        in the same step, and their users' next requests would arrive together again, and queue for the prefill."""
        request.joins = max(self._steps_done + 1, self._next_join)
        self._next_join = request.joins + 1
        self._settle(request, Proposal.empty(), logits, draft_s=0.0, target_s=target_s)

    def _draft_lengths(self, ready: list[_Request]) -> list[int]:
        preferred = []
        for request in ready:
            k = request.draft_len.k if request.draft is not None else 0
            preferred.append(max(0, min(k, request.room())))
        if self.draft_schedule is not None:
            k = scheduled_draft_length(self.draft_schedule, len(ready))
            return [min(k, p) if r.draft is not None else 0 for r, p in zip(ready, preferred)]
        fixed = [r.cfg.draft_length == "fixed" for r in ready]
        acceptances = [getattr(r.draft_len, "acceptance", 0.5) for r in ready]
        planned = plan_batch_draft_lengths(acceptances, preferred, self.costs, self.batch_costs, self.draft_batch_costs)
        # A request that asked for a fixed K gets it (benchmarks sweep K); the plan decides for the rest, and a
        # speculating row whose draft stops by its confidence is asked for its ceiling (RequestState.draft_k).
        return [p if f else min(r.draft_k(), r.room()) if k > 0 else 0
                for r, p, f, k in zip(ready, preferred, fixed, planned)]

    def _finish(self, request: _Request, done: bool = True) -> None:
        if request in self.running:
            self.running.remove(request)
        if request.row is not None:
            self.batch.release(request.row)
            request.row = None
        if request.draft is not None:
            request.draft.close()  # a batched model draft frees its row
        if done:
            self._hand_over(request, _DONE)

    def _fail(self, request: _Request, err: Exception) -> None:
        self._hand_over(request, err if isinstance(err, SpecpipeError) else RuntimeError(f"{type(err).__name__}: {err}"))
        self._finish(request, done=False)
