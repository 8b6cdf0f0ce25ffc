"""The verify curve a record's decoding calls give (engines/timing.py `in_decoding_curve`), recomputed from what a
manifest or a verdict records: tests check the recorded curve against it."""

from __future__ import annotations

from typing import Sequence

from specpipe.engines.timing import MIN_CALLS, curve_of


def curve_from_calls(calls: dict[str, list[float]], timed: Sequence[float]) -> list[float]:
    """`calls`: {tokens: [calls, median ms]} ("1": the target alone's steps; speculative/stats.py `calls_summary`);
    `timed`: the curve timed alone. Each point with at least MIN_CALLS calls is its median over the 1-token median, the
    timed point elsewhere, floored as `curve_of` floors. The recorded medians are rounded to 1e-4 ms, so compare with a
    relative tolerance (~0.2% for a tiny model's ~0.1-ms calls)."""
    one_ms = calls["1"][1]
    relative = {1 + k: (calls[str(1 + k)][1] / one_ms if calls.get(str(1 + k), [0])[0] >= MIN_CALLS else timed[k - 1])
                for k in range(1, len(timed) + 1)}
    return list(curve_of(relative, 1.0, len(timed)))
