"""How long one engine call takes: what adaptive K's step costs (speculative/adaptive.py) and the
benchmarks' engine rows are measured with."""

from __future__ import annotations

import statistics
import time


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
