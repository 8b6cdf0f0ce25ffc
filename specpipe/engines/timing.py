"""How long one engine call takes: what the build's step and batch costs (builder/measure.py) and the
benchmarks' engine rows are measured with."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Sequence


def step_ms(engine, new_tokens: int, *, context_len: int = 64, repeats: int = 20) -> float:
    """Median ms of one engine call adding `new_tokens` on top of a `context_len`-token cache."""
    seq = engine.new_sequence()
    vocab = getattr(engine, "vocab_size", 1000)
    seq.append([(7 * i + 3) % vocab for i in range(context_len)])
    token = [11 % vocab] * new_tokens
    seq.append(token)  # warm-up
    seq.truncate(context_len)
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        seq.append(token)
        seconds.append(time.perf_counter() - t0)
        seq.truncate(context_len)
    return statistics.median(seconds) * 1e3


VERIFY_CURVE_TOKENS = 4  # drafts whose verify call is timed one count at a time (StepCosts.verify)


def curve_of(ms_by_tokens: dict[int, float], one_ms: float, max_drafts: int = VERIFY_CURVE_TOKENS) -> tuple[float, ...]:
    """A call on 1 + k tokens relative to a one-token step of `one_ms`, k = 1 .. max_drafts (StepCosts.verify), from
    calls already timed ({tokens: ms}, 2 .. 1 + max_drafts; `calls_ms`). Each is at least 1 and at least the one
    before: a call on more tokens costs no less, so a smaller reading is timing noise, which would otherwise make a
    longer draft look free."""
    curve, floor = [], 1.0
    for k in range(1, max_drafts + 1):
        floor = max(floor, ms_by_tokens[1 + k] / one_ms)
        curve.append(round(floor, 4))
    return tuple(curve)


# Calls of one size a median needs before it replaces the curve's timed point (`in_decoding_curve`).
MIN_CALLS = 8


def in_decoding_curve(one_token_s: Sequence[float], calls_s: dict[int, list[float]], timed: Sequence[float], *,
                      min_calls: int = MIN_CALLS) -> tuple[float, ...]:
    """The verify curve (StepCosts.verify) as decoding paid it: for each k with at least `min_calls` calls on 1 + k
    tokens (`calls_s`, seconds, SpecStats.call_s), their median over the median of the target alone's 1-token steps
    of the same run (`one_token_s`); the `timed` point where decoding made fewer (adaptive K seldom drafts the
    longest blocks). Floored as every curve is (`curve_of`). `timed` unchanged when the target alone made fewer than
    `min_calls` 1-token steps. What the build's sample bench (builder/measure.py) and the distill verdict
    (distill/verdict.py) record: the curve `calls_ms` times alone moved from reading to reading on one VM (a 2-token
    call 1.04-1.18 of a step on a Zen 4) while decoding paid ~1.15 (docs/eagle3-decoding.md, session 44)."""
    if len(one_token_s) < min_calls or not timed:
        return tuple(timed)
    one = statistics.median(one_token_s)
    relative = {1 + k: (statistics.median(calls_s[1 + k]) / one if len(calls_s.get(1 + k, ())) >= min_calls
                        else timed[k - 1]) for k in range(1, len(timed) + 1)}
    return curve_of(relative, 1.0, len(timed))


def pooled_calls(runs) -> dict[int, list[float]]:
    """The target calls of several decoding runs (each with `call_s`, SpecStats' {tokens: [seconds]}), pooled."""
    calls: dict[int, list[float]] = {}
    for run in runs:
        for n, seconds in run.call_s.items():
            calls.setdefault(n, []).extend(seconds)
    return calls


def calls_ms(engine, token_counts: Sequence[int], *, context_len: int = 64, repeats: int = 20) -> dict[int, float]:
    """Median ms of one engine call adding n tokens on top of a `context_len`-token cache, for each n in
    `token_counts`, the counts taking turns call by call: their ratios (a verify call over a one-token step) then
    come from the same seconds, where timing each count's calls in a block of its own let the machine's drift
    between blocks into the ratio (the distill verdict's K=1 verify read 1.03 and 1.24 of a step in two runs on the
    same CPU, against ~1.12 in decoding)."""
    seq = engine.new_sequence()
    vocab = getattr(engine, "vocab_size", 1000)
    seq.append([(7 * i + 3) % vocab for i in range(context_len)])
    counts = list(dict.fromkeys(token_counts))
    seconds: dict[int, list[float]] = {n: [] for n in counts}
    for round_ in range(repeats + 1):  # the first round is a warm-up
        for n in counts:
            t0 = time.perf_counter()
            seq.append([11 % vocab] * n)
            if round_:
                seconds[n].append(time.perf_counter() - t0)
            seq.truncate(context_len)
    return {n: statistics.median(seconds[n]) * 1e3 for n in counts}


def head_step_ms(head, *, context_len: int = 64, repeats: int = 20, between: Optional[Callable[[], None]] = None) -> float:
    """Median ms of one EAGLE-3 draft step (engines/eagle3_head.py) on a `context_len`-row cache: what the head
    costs per drafted token. The features are made up: the time does not depend on their values. `between`, when
    given, runs untimed before each step: in decoding a target call runs between two head calls and streams the
    target's weights through the caches, so the head reads its own from memory again (`target_step` below). On
    the Zen 4 CPU here that doubled or tripled a step: SmolLM2-135M's head in int8, 0.26 ms hot, 0.97 ms after an
    int8-wo target call (docs/eagle3-decoding.md)."""
    import numpy as np

    cache = head.new_cache()
    features = np.random.default_rng(0).standard_normal((context_len, head.feature_width)).astype(np.float32)
    tokens = [int(head.token_ids[i % len(head.token_ids)]) for i in range(context_len)]
    _, state = head.context_rows(cache, tokens, features)
    seconds = []
    for _ in range(repeats + 1):  # the first is a warm-up
        if between is not None:
            between()
        t0 = time.perf_counter()
        head.draft_step(cache, tokens[0], state)
        seconds.append(time.perf_counter() - t0)
        cache.truncate(context_len)
    return statistics.median(seconds[1:]) * 1e3


def target_step(engine, *, context_len: int = 64) -> Callable[[], None]:
    """One decode step of `engine` on a `context_len`-token cache, as a callable (`head_step_ms`'s `between`)."""
    seq = engine.new_sequence()
    vocab = getattr(engine, "vocab_size", 1000)
    seq.append([(7 * i + 3) % vocab for i in range(context_len)])

    def step() -> None:
        seq.append([11 % vocab])
        seq.truncate(context_len)

    return step


def batch_step_ms(engine, rows: int, *, context_len: int = 64, repeats: int = 5) -> float:
    """Median ms of one batched call appending one token to each of `rows` rows, each holding a
    `context_len`-token cache. An engine without batched calls runs its rows one by one."""
    return batch_steps_ms([engine], rows, context_len=context_len, repeats=repeats)[0]


def batch_steps_ms(engines, rows: int, *, context_len: int = 64, repeats: int = 5) -> list[float]:
    """`batch_step_ms` of each of `engines`, timed in turn call by call (A B C A B C ...), so load from other
    processes on a shared machine falls on all of them alike and their ratios hold."""
    setups = []
    for engine in engines:
        vocab = engine.vocab_size
        context = [(7 * i + 3) % vocab for i in range(context_len)]
        batch = engine.new_batch(rows)
        sequences = [batch.new_sequence() for _ in range(rows)]
        for sequence in sequences:
            sequence.append(context)
        tokens = [11 % vocab] * rows
        batch.decode(sequences, tokens)  # warm-up
        setups.append((batch, sequences, tokens))
    seconds: list[list[float]] = [[] for _ in engines]
    for _ in range(repeats):
        for (batch, sequences, tokens), times in zip(setups, seconds):
            for sequence in sequences:
                sequence.truncate(context_len)
            t0 = time.perf_counter()
            batch.decode(sequences, tokens)
            times.append(time.perf_counter() - t0)
    return [statistics.median(times) * 1e3 for times in seconds]
