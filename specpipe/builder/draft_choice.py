"""Which of several --draft candidates `build` deploys: the fastest, or none.

The candidates are measured first (builder/measure.py `measure_candidates`). Choice (`choose`, a pure
function of the measurements): the fastest candidate when it is at least `min_speedup` times as fast as
the target alone, else "none": the target alone is deployed, and every request decodes target-only. A draft
that makes decoding slower is never deployed.
"""

from __future__ import annotations

from typing import Sequence

from specpipe.contract.manifest import CandidateMeasurement

NONE = "none"  # the candidate that is always there: the target alone


def choose(measurements: Sequence[CandidateMeasurement], min_speedup: float) -> tuple[str, str]:
    """(the --draft value to deploy, why). "none" when no draft is at least `min_speedup` times as fast as the
    target alone. Ties go to the candidate given first."""
    drafts = [m for m in measurements if m.kind != "none" and m.speedup is not None]
    if not drafts:
        return NONE, "no draft candidate was measured: deploying the target alone"
    best = max(drafts, key=lambda m: m.speedup)
    if best.speedup >= min_speedup:
        return best.draft, (f"{best.draft} was the fastest candidate, {best.speedup:.2f}x the target alone "
                            f"(a draft is deployed from {min_speedup:.2f}x)")
    return NONE, (f"no draft was {min_speedup:.2f}x as fast as the target alone (best: {best.draft} at "
                  f"{best.speedup:.2f}x): deploying the target alone")

