"""Peer rows beside specpipe's: the ratio to specpipe's same row, and each peer checked against itself.

Conventions (the bench JSON's per-row fields; the harness's `speedup` stays "vs specpipe's target-only"):
- own_speedup: a peer row's speedup over the same peer's target-only runs, paired by prompt as the harness's
  `speedup` is (the geometric mean of per-prompt ratios; own_speedup_ci95 its 95% interval).
- vs_specpipe: a row's median tokens/s / specpipe's row of the same strategy and K (target-only with
  target-only; draft-model K=4 with specpipe's K=4 when specpipe drafts with a model; a peer's own
  modes, adaptive or prompt lookup with its own settings, with specpipe's adaptive row of the same
  strategy). None where specpipe has no such row.
- matches_target for a peer row: prompts whose ids equal that peer's own target-only ids (greedy
  speculative decoding must reproduce its own engine's target alone); `mismatches` lists the others
  with the first token index that differs.
"""

from __future__ import annotations

from typing import Optional, Sequence

from specpipe.bench.harness import BASELINE, Measurement, paired_speedup, prompt_ratios


def own_baseline_label(peer: Optional[str]) -> str:
    return BASELINE if peer is None else f"{peer} {BASELINE}"


def first_difference(ids: Sequence[int], reference: Sequence[int]) -> Optional[int]:
    """Index of the first token where two id lists differ (a length difference counts); None if equal."""
    for index, (a, b) in enumerate(zip(ids, reference)):
        if a != b:
            return index
    return None if len(ids) == len(reference) else min(len(ids), len(reference))


def mismatches(runs: list[Measurement], reference: list[Measurement]) -> list[dict]:
    """The prompts whose ids differ from the reference row's, each with where they first differ."""
    out = []
    for run, ref in zip(runs, reference):
        index = first_difference(run.token_ids, ref.token_ids)
        if index is not None:
            out.append({"prompt_id": run.prompt_id, "first_difference_at": index})
    return out


def check_against_own(row: dict, runs: list[Measurement], own_baseline: Optional[list[Measurement]]) -> dict:
    """Fill a peer row's own_speedup, matches_target and mismatches from the same peer's target-only runs."""
    if not own_baseline:
        row.update(own_speedup=None, own_speedup_ci95=None, matches_target=None, mismatches=[])
        return row
    different = mismatches(runs, own_baseline)
    row["own_speedup"], row["own_speedup_ci95"] = paired_speedup(prompt_ratios(runs, own_baseline))
    row["matches_target"] = len(runs) - len(different)
    row["mismatches"] = different
    return row


def same_specpipe_row(row: dict, table: list[dict]) -> Optional[dict]:
    """specpipe's row with the same strategy and K as `row` (a peer's), or None."""
    for other in table:
        if other.get("peer") is None and other.get("strategy") == row.get("strategy") and other["k"] == row["k"]:
            return other
    return None


def add_vs_specpipe(table: list[dict]) -> list[dict]:
    """Set vs_specpipe on every peer row of one prompt set's table (specpipe rows get None)."""
    for row in table:
        mine = same_specpipe_row(row, table) if row.get("peer") else None
        row["vs_specpipe"] = (row["tokens_per_s"] / mine["tokens_per_s"]
                              if mine is not None and mine["tokens_per_s"] else None)
    return table


def peer_best(table: list[dict]) -> dict[str, dict]:
    """Per peer, its fastest speculative row (fixed K or its own modes) by median tokens/s."""
    best: dict[str, dict] = {}
    for row in table:
        peer = row.get("peer")
        if peer is None or row.get("strategy") == "target-only":
            continue
        if peer not in best or row["tokens_per_s"] > best[peer]["tokens_per_s"]:
            best[peer] = {key: row.get(key) for key in ("label", "strategy", "k", "tokens_per_s", "own_speedup",
                                                        "vs_specpipe", "acceptance_rate")}
    return best
