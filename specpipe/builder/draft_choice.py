"""Which of several --draft candidates `build` deploys: the fastest, or none.

The candidates are measured first (builder/measure.py `measure_candidates`). Choice (`choose`, a pure
function of the measurements): the fastest candidate when it is at least `min_speedup` times as fast as
the target alone, else "none": the target alone is deployed, and every request decodes target-only. A draft
that makes decoding slower is never deployed.

When none is deployed, the reason also says which of a draft's two levers fell short, from the best candidate's own
numbers: L = tokens a target call (mean_accepted_len, the bonus token counted) and s = its speedup give the cost of one
of its calls, drafting included, as L / s steps of the target alone (tokens/s = L / call time; the target alone's =
1 / step time); at that cost the line needs min_speedup x L / s tokens a call. On an int8-wo target with VNNI a verify
call's extra tokens are what costs (docs/quantization.md, session 40); elsewhere acceptance is.
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
                  f"{best.speedup:.2f}x{_where_the_time_went(best, min_speedup)}): deploying the target alone")


def _where_the_time_went(best: CandidateMeasurement, min_speedup: float) -> str:
    """The reason's account of the best candidate's calls (module docstring): its tokens a target call, what one call
    costs in steps of the target alone, and the tokens a call `min_speedup` needs at that cost; "" when the
    measurement has no tokens a call. `best.speedup` is set (`choose` keeps only measured candidates)."""
    tokens_a_call = best.mean_accepted_len
    if not tokens_a_call or best.speedup <= 0:
        return ""
    call_cost = tokens_a_call / best.speedup
    return (f", {tokens_a_call:.2f} tokens a target call, each call with its drafting costing {call_cost:.2f} steps "
            f"of the target alone: {min_speedup:.2f}x needs {min_speedup * call_cost:.2f} tokens a call")

