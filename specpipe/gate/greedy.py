"""Check 1, greedy equivalence: for every prompt, speculative token ids == target-only token ids.

A mismatch is reported with the prompt, the position, both tokens, and the target's top-2 logit margin at
that position, computed by the reference target engine in-process on the shared context. A margin below
`near_tie_margin` means the two runs saw a numerical near-tie (the verify call scores K+1 positions at
once, target-only decoding one: the float sums differ in the last bits) and counts as a warning; a larger
margin is a real bug and fails the check.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from specpipe.config import GateConfig
from specpipe.gate.report import CheckResult
from specpipe.gate.subjects import Subject, Tick

NAME = "greedy_equivalence"


def check_greedy(subject: Subject, gate: GateConfig, tick: Tick) -> CheckResult:
    cfg = gate.greedy
    tokenizer = subject.reference.tokenizer
    failures, warnings, per_prompt = [], [], []
    for prompt in gate.prompts:
        speculative = subject.greedy_ids(prompt, cfg.max_new_tokens, gate.num_draft_tokens)
        target_only = subject.greedy_ids(prompt, cfg.max_new_tokens, 0)
        tick(1)
        entry = {"prompt": prompt, "tokens": len(target_only), "match": speculative == target_only}
        per_prompt.append(entry)
        if entry["match"]:
            continue
        position = _first_difference(speculative, target_only)
        context = subject.encode(prompt) + target_only[:position]
        margin, argmax = _top2_margin(subject.reference.target, context)
        entry.update(
            position=position,
            speculative_token=_token(speculative, position),
            target_only_token=_token(target_only, position),
            reference_argmax=argmax,
            top2_logit_margin=margin,
            near_tie=margin < cfg.near_tie_margin,
        )
        message = (
            f"prompt {prompt!r}: position {position}: speculative {_describe(tokenizer, speculative, position)}"
            f" != target-only {_describe(tokenizer, target_only, position)}; reference argmax {argmax},"
            f" target top-2 logit margin {margin:.3g}"
        )
        if entry["near_tie"]:
            warnings.append(f"{message} < {cfg.near_tie_margin:g}: a numerical near-tie")
        else:
            failures.append(f"{message} >= {cfg.near_tie_margin:g}: not a near-tie")

    matched = sum(e["match"] for e in per_prompt)
    metrics = {
        "prompts": len(per_prompt),
        "matched": matched,
        "near_ties": len(warnings),
        "real_mismatches": len(failures),
        "num_draft_tokens": gate.num_draft_tokens,
        "max_new_tokens": cfg.max_new_tokens,
        "near_tie_margin": cfg.near_tie_margin,
        "per_prompt": per_prompt,
    }
    summary = f"{matched}/{len(per_prompt)} prompts identical, {len(warnings)} near-tie, {len(failures)} real mismatch"
    return CheckResult(NAME, "failed" if failures else "passed", summary, failures, warnings, metrics)


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))  # one output is a prefix of the other: it stopped early


def _token(ids: list[int], position: int) -> Optional[int]:
    return ids[position] if position < len(ids) else None


def _describe(tokenizer, ids: list[int], position: int) -> str:
    token = _token(ids, position)
    if token is None:
        return "<end of output>"
    return f"{token} ({tokenizer.decode([token])!r})"


def _top2_margin(target, context: list[int]) -> tuple[float, int]:
    """(largest logit - second largest, argmax) of the target's next-token logits after `context`."""
    logits = target.new_sequence().append(context)[-1]  # [V]
    top2 = np.partition(logits, -2)[-2:]
    return float(top2.max() - top2.min()), int(logits.argmax())
