"""What the gate runs its checks on: a deployment in this process, or one served by Triton.

Both kinds answer the same questions (greedy token ids, the first two sampled tokens, timed requests), so
each check is written once. Every subject also holds `reference`, the deployment opened in-process: the
target's exact probabilities, logit margins and the manifest come from it, even when the tokens under
test come from a server.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from specpipe.contract.generation import GenerationConfig, SamplingConfig
from specpipe.errors import ServerError
from specpipe.speculative.decoder import SpeculativeDecoder
from specpipe.speculative.drafters import ModelDrafter
from specpipe.speculative.stats import SpecStats

Tick = Callable[[int], None]  # advance a progress bar by n


@dataclass
class RequestTiming:
    """One measured request. itl_ms = (total - ttft) / (tokens - 1), genai-perf's per-request convention."""

    ttft_ms: float
    total_ms: float
    num_tokens: int
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position, as SpecStats
    accepted_at: list[int] = field(default_factory=list)

    @property
    def itl_ms(self) -> Optional[float]:
        return (self.total_ms - self.ttft_ms) / (self.num_tokens - 1) if self.num_tokens > 1 else None


@dataclass
class TimedRun:
    requests: list[RequestTiming]
    wall_s: float  # first measured request sent -> last one done, all clients together


class Subject(ABC):
    mode: str
    reference: object  # specpipe.deployment.Deployment
    chat: bool

    def _config(self, max_new_tokens: int, num_draft_tokens: Optional[int], **fields) -> GenerationConfig:
        """A request as the gate asks it: K as deployed (None), the target alone (0) or fixed (DecodingPolicy.request)."""
        return self.reference.decoding.request(num_draft_tokens, max_new_tokens=max_new_tokens, **fields)

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt, exactly as the deployment's generator makes them (in-process and served)."""
        return self.reference.generator.encode(text, self.chat)

    def without_draft(self) -> bool:
        """The deployment decodes with the target alone (build chose no draft): nothing for a draft threshold to judge."""
        return self.reference.drafter is None

    def distribution_cases(self, gate, budget: Optional[int]) -> Optional[list]:
        """The distribution check's cases (distribution.Case), or None for the default: the target's exact p from the
        reference engine (distribution.plan_cases, applied by the gate's runner)."""
        return None

    def unsupported(self, check: str) -> Optional[str]:
        """Why `check` cannot run on this subject (the report says it), or None when it can."""
        return None

    def limitations(self) -> list[str]:
        """What the checks that run cannot establish on this subject: the report's `not_checked`."""
        return []

    @abstractmethod
    def greedy_ids(self, prompt: str, max_new_tokens: int, num_draft_tokens: int) -> list[int]:
        """Greedy output token ids; num_draft_tokens 0 = target only."""

    @abstractmethod
    def first_two(
        self, context: str, sampling: SamplingConfig, n: int, draft_lengths: Sequence[int], seed: int, tick: Tick
    ) -> np.ndarray:
        """[n, 2] first two tokens emitted after `context`, one seeded request each (seeds seed..seed+n-1);
        K = draft_lengths[i % len]. EOS does not stop a sample."""

    @abstractmethod
    def timed_run(
        self, prompts: Sequence[str], max_new_tokens: int, num_draft_tokens: Optional[int], concurrency: int, requests: int,
        warmup: int, tick: Tick,
    ) -> TimedRun:
        """Greedy requests over `prompts` (round robin) with `concurrency` in flight; warm-up not measured."""

    def close(self) -> None:
        pass


def run_concurrently(one: Callable[[int], RequestTiming], concurrency: int, requests: int, warmup: int, tick: Tick) -> TimedRun:
    """Run one(i) for i < warmup (not measured), then for the measured requests, `concurrency` at a time."""
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, range(warmup)))
        start = time.perf_counter()

        def measured(i: int) -> RequestTiming:
            timing = one(warmup + i)
            tick(1)
            return timing

        timings = list(pool.map(measured, range(requests)))
    return TimedRun(timings, time.perf_counter() - start)


class InProcessSubject(Subject):
    """The deployment's engines in this process: the same SpecGenerator `specpipe generate` runs."""

    mode = "in-process"

    def __init__(self, deployment, *, chat: bool = False):
        from specpipe.gate.memo import MemoEngine

        self.reference = deployment
        self.chat = chat
        self.alone = None  # the unpadded target alone, loaded for the first target-only timed run
        drafter = deployment.drafter
        if isinstance(drafter, ModelDrafter):
            drafter = ModelDrafter(MemoEngine(drafter.engine), drafter.target_vocab_size)
        # Sampling runs the unchanged decoder on engines that remember logits by prefix (see memo.py).
        self.sampler = SpeculativeDecoder(MemoEngine(deployment.target), drafter, deployment.generator.decoder.eos_token_ids,
                                          deployment.costs)

    def greedy_ids(self, prompt, max_new_tokens, num_draft_tokens):
        cfg = self._config(max_new_tokens, num_draft_tokens)
        return self.reference.generator.generate(self.encode(prompt), cfg).token_ids

    def first_two(self, context, sampling, n, draft_lengths, seed, tick):
        context_ids = self.encode(context)
        configs = {k: self._config(k + 1, k, sampling=sampling, stop_on_eos=False) for k in set(draft_lengths)}
        out = np.empty((n, 2), dtype=np.int64)
        for i in range(n):
            cfg = configs[draft_lengths[i % len(draft_lengths)]]
            cfg.seed = seed + i
            emitted: list[int] = []
            steps = self.sampler.decode(context_ids, cfg, SpecStats())
            for tokens in steps:
                emitted += tokens
                if len(emitted) >= 2:
                    break
            steps.close()
            out[i] = emitted[:2]
            if i % 100 == 99:
                tick(100)
        tick(n % 100)
        return out

    def timed_run(self, prompts, max_new_tokens, num_draft_tokens, concurrency, requests, warmup, tick):
        """num_draft_tokens 0 times the target alone as a deployment without a draft runs it (unpadded,
        Deployment.target_alone), the speed speculation must beat; the greedy checks keep the deployment's own."""
        cfg = self._config(max_new_tokens, num_draft_tokens)
        if num_draft_tokens == 0 and self.alone is None:
            self.alone = self.reference.target_alone()
        generator = self.alone if num_draft_tokens == 0 else self.reference.generator
        prompt_ids = [self.encode(p) for p in prompts]

        def one(i: int) -> RequestTiming:
            result = generator.generate(prompt_ids[i % len(prompt_ids)], cfg)
            stats = result.stats
            return RequestTiming(
                ttft_ms=result.ttft_ms, total_ms=result.total_ms, num_tokens=result.num_generated,
                drafted=stats.drafted, accepted=stats.accepted,
                drafted_at=list(stats.drafted_at), accepted_at=list(stats.accepted_at),
            )

        return run_concurrently(one, concurrency, requests, warmup, tick)


def answers_after_bad_requests(good_request: Callable[[], Any], failures: list[str]) -> bool:
    """The robustness check's last step, on a server or an endpoint: a good request after the bad ones must still get
    a non-empty answer (`good_request` returns it); a failure is added to `failures`."""
    try:
        if good_request():
            return True
        failures.append("after the bad requests, a good request got an empty answer")
    except ServerError as err:
        failures.append(f"after the bad requests, a good request failed: {err}")
    return False
