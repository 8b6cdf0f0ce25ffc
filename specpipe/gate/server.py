"""The gate's server side: a deployment served by Triton, reached over gRPC with specpipe.triton's client,
and check 5 (robustness smoke), which only makes sense against a server.

Requests carry the whole GenerationConfig (the client's `generation_config` input), so a served request
decodes exactly as the in-process one with the same seed; seeds are per request.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

from specpipe.contract.generation import GenerationConfig
from specpipe.errors import GateError, ServerError
from specpipe.gate.config import GateConfig
from specpipe.gate.report import CheckResult
from specpipe.gate.subjects import RequestTiming, Subject, Tick, TimedRun, answers_after_bad_requests

ROBUSTNESS = "robustness"


def check_reachable(url: str, model_name: str, timeout_s: float = 3.0) -> None:
    """Fail fast (GateError, exit 2) when nothing answers at `url` or the model is not ready."""
    from specpipe.triton.client import check_ready

    try:
        check_ready(url, model_name, timeout_s)
    except ServerError as err:
        raise GateError(str(err)) from None


class ServerSubject(Subject):
    mode = "server"

    def __init__(self, url: str, reference, *, model_name: str, chat: bool = False, timeout_s: float = 300.0):
        self.url, self.reference, self.model_name, self.chat, self.timeout_s = url, reference, model_name, chat, timeout_s

    def generate(self, prompt: str, cfg: GenerationConfig, *, stream: bool) -> dict:
        from specpipe.triton.client import remote_generate

        generation = remote_generate(self.url, prompt, cfg, stream=stream, chat=self.chat, model_name=self.model_name,
                                     timeout_s=self.timeout_s)
        for _ in generation:
            pass
        return generation.result

    def greedy_ids(self, prompt, max_new_tokens, num_draft_tokens):
        return self.generate(prompt, self._config(max_new_tokens, num_draft_tokens), stream=False)["token_ids"]

    def first_two(self, context, sampling, n, draft_lengths, seed, tick, *, concurrency: int = 2):
        configs = {k: self._config(k + 1, k, sampling=sampling, stop_on_eos=False) for k in set(draft_lengths)}

        def one(i: int) -> list[int]:
            cfg = configs[draft_lengths[i % len(draft_lengths)]].model_copy(update={"seed": seed + i})
            ids = self.generate(context, cfg, stream=False)["token_ids"]
            tick(1)
            return (ids + [-1, -1])[:2]

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return np.array(list(pool.map(one, range(n))), dtype=np.int64)

    def timed_run(self, prompts, max_new_tokens, num_draft_tokens, concurrency, requests, warmup, tick):
        """Closed-loop streaming users, as `specpipe loadtest` runs a level (specpipe.triton.load)."""
        from specpipe.triton.client import request_tensors
        from specpipe.triton.load import run_level

        cfg = self._config(max_new_tokens, num_draft_tokens)
        make_request = lambda i: request_tensors(prompts[i % len(prompts)], cfg, stream=True, chat=self.chat)  # noqa: E731
        if warmup:
            run_level(self.url, self.model_name, make_request, concurrency, warmup, timeout_s=self.timeout_s)
        level = run_level(self.url, self.model_name, lambda i: make_request(warmup + i), concurrency, requests,
                          timeout_s=self.timeout_s, on_done=lambda record: tick(1))
        failed = [r for r in level.records if r.error is not None]
        if failed:  # an SLO over the requests that happened to succeed would say nothing
            raise ServerError(f"{len(failed)} of {requests} timed requests failed at concurrency {concurrency}: "
                              f"{failed[0].error}")
        return TimedRun([_timing(r.result) for r in level.records], level.wall_s)


def _timing(result: dict) -> RequestTiming:
    drafted_at, accepted_at = _position_counts(result)
    return RequestTiming(
        ttft_ms=result["ttft_ms"], total_ms=result["total_ms"], num_tokens=result["num_generated"],
        drafted=int(result.get("drafted", 0)), accepted=int(result.get("accepted", 0)),
        drafted_at=drafted_at, accepted_at=accepted_at,
    )


def _position_counts(result: dict) -> tuple[list[int], list[int]]:
    """Per-position drafted/accepted counts from a served result's statistics. When the server reports only
    the per-position rates, every verification step is taken to have drafted at every position (true for
    fixed K except where the step was cut short by max_tokens)."""
    if "drafted_at" in result and "accepted_at" in result:
        return list(result["drafted_at"]), list(result["accepted_at"])
    rates = result.get("per_position_acceptance") or []
    steps = int(result.get("steps", 0))
    return [steps] * len(rates), [round(rate * steps) for rate in rates]


def bad_requests(reference) -> dict[str, dict[str, np.ndarray]]:
    """Requests the server must refuse, each with a clear message: name -> request tensors."""
    from specpipe.triton.client import request_tensors

    good = request_tensors("Hello", GenerationConfig(max_new_tokens=4), stream=False)
    too_long = reference.target.max_seq_len + 1

    def variant(**changes) -> dict[str, np.ndarray]:
        tensors = {k: v for k, v in good.items() if k != "generation_config"}  # test the TRT-LLM tensors alone
        for name, value in changes.items():
            if value is None:
                tensors.pop(name, None)
            else:
                tensors[name] = value
        return tensors

    return {
        "missing text_input": variant(text_input=None),
        "empty prompt": variant(text_input=np.array([[b""]], dtype=np.object_)),
        "max_tokens 0": variant(max_tokens=np.array([[0]], dtype=np.int32)),
        "max_tokens negative": variant(max_tokens=np.array([[-5]], dtype=np.int32)),
        f"max_tokens {too_long} above the engine limit": variant(max_tokens=np.array([[too_long]], dtype=np.int32)),
        "temperature negative": variant(temperature=np.array([[-1.0]], dtype=np.float32)),
        "max_tokens as FP32 (wrong dtype)": variant(max_tokens=np.array([[4.0]], dtype=np.float32)),
        "unknown input": variant(not_an_input=np.array([[1]], dtype=np.int32)),
    }


def check_robustness(subject: Optional[ServerSubject], gate: GateConfig, tick: Tick) -> CheckResult:
    if subject is None:
        return CheckResult(ROBUSTNESS, "skipped", "server modes only (nothing to send bad requests to in-process)")
    from specpipe.triton.client import RemoteGeneration

    failures, refused = [], {}
    for name, tensors in bad_requests(subject.reference).items():
        generation = RemoteGeneration(subject.url, tensors, model_name=subject.model_name, timeout_s=60.0)
        try:
            for _ in generation:
                pass
            failures.append(f"{name}: accepted, answered {generation.result.get('num_generated')} tokens")
            refused[name] = None
        except ServerError as err:
            message = str(err).removeprefix("the server refused the request: ").strip()
            refused[name] = message
            if not message:
                failures.append(f"{name}: refused without a message")
        tick(1)
    still_serving = answers_after_bad_requests(lambda: subject.greedy_ids(gate.prompts[0], 8, gate.num_draft_tokens),
                                               failures)
    tick(1)
    metrics = {"refused": refused, "still_serving": still_serving}
    summary = (
        f"{sum(m is not None for m in refused.values())}/{len(refused)} bad requests refused with a message;"
        f" server {'still answers' if still_serving else 'does NOT answer'} afterwards"
    )
    return CheckResult(ROBUSTNESS, "failed" if failures else "passed", summary, failures, [], metrics)
