"""Check 1, greedy equivalence: for every prompt, speculative token ids == target-only token ids.

The rule is `specpipe.speculative.equivalence` (shared with the tests): a first divergence is a numerical
near-tie, a warning, when the target-only run's top-2 logits there are within the target precision's
tolerance (`near_tie_margin` overrides it) and the speculative token is one of the tied ones; otherwise it
is a real mismatch and fails the check. The margin is replayed in-process on the reference target engine,
one token per call as target-only decoding runs. Outputs are compared no further than the first divergence.
"""

from __future__ import annotations

from specpipe.gate.config import GateConfig
from specpipe.gate.report import CheckResult
from specpipe.gate.subjects import Subject, Tick
from specpipe.speculative.equivalence import compare_greedy, near_tie_tolerance

NAME = "greedy_equivalence"


def check_greedy(subject: Subject, gate: GateConfig, tick: Tick) -> CheckResult:
    if subject.reference is None or not getattr(subject, "token_ids", True):
        return check_greedy_text(subject, gate, tick)
    cfg = gate.greedy
    tokenizer = subject.reference.tokenizer
    target_quant = subject.reference.manifest.target.engine.quant
    tolerance = cfg.near_tie_margin if cfg.near_tie_margin is not None else near_tie_tolerance(target_quant)
    consistency = subject.reference.manifest.target.verify_consistency
    failures, warnings, per_prompt = [], [], []
    for prompt in gate.prompts:
        speculative = subject.greedy_ids(prompt, cfg.max_new_tokens, gate.num_draft_tokens)
        target_only = subject.greedy_ids(prompt, cfg.max_new_tokens, 0)
        tick(1)
        divergence = compare_greedy(subject.reference.target, subject.encode(prompt), speculative, target_only, tolerance)
        entry = {"prompt": prompt, "tokens": len(target_only), "match": divergence is None}
        per_prompt.append(entry)
        if divergence is None:
            continue
        entry.update(divergence.as_dict(), reference_argmax=divergence.target_argmax,
                     top2_logit_margin=divergence.top2_margin)
        position = divergence.position
        message = (
            f"prompt {prompt!r}: position {position}: speculative {_describe(tokenizer, divergence.speculative_token)}"
            f" != target-only {_describe(tokenizer, divergence.target_only_token)}; reference argmax"
            f" {divergence.target_argmax}, target top-2 logit margin {divergence.top2_margin:.3g}"
        )
        if divergence.near_tie:
            warnings.append(f"{message} <= {tolerance:g}: a numerical near-tie")
        else:
            failures.append(f"{message}: not a near-tie (tolerance {tolerance:g})")
    if consistency is None:
        warnings.append("the build recorded no verify_consistency for the target (built before specpipe measured it):"
                        " rebuild so its 1-token steps score like verify rows")
    elif not consistency.within_tolerance:
        # The build measured the target scoring a position differently alone than inside a verify call by
        # more than the near-tie rule allows: greedy speculative output is not guaranteed to be the target's.
        warnings.append(
            f"the target engine ({target_quant}) is not verify-consistent: its logits for a position differ by up to"
            f" {consistency.max_abs_logit_diff:.3g} between a 1-token decode and a {consistency.chunk}-token"
            f" verify call (near-tie tolerance {tolerance:g}); speculative greedy output may differ from target-only"
        )

    matched = sum(e["match"] for e in per_prompt)
    near_ties = sum(1 for e in per_prompt if e.get("near_tie"))
    metrics = {
        "prompts": len(per_prompt),
        "matched": matched,
        "near_ties": near_ties,
        "real_mismatches": len(failures),
        "num_draft_tokens": gate.num_draft_tokens,
        "max_new_tokens": cfg.max_new_tokens,
        "near_tie_margin": tolerance,
        "target_quant": target_quant,
        "verify_consistency": consistency.model_dump() if consistency is not None else None,
        "per_prompt": per_prompt,
    }
    summary = f"{matched}/{len(per_prompt)} prompts identical, {near_ties} near-tie, {len(failures)} real mismatch"
    return CheckResult(NAME, "failed" if failures else "passed", summary, failures, warnings, metrics)


def _describe(tokenizer, token) -> str:
    if token is None:
        return "<end of output>"
    return f"{token} ({tokenizer.decode([token])!r})"


def check_greedy_text(subject, gate: GateConfig, tick: Tick) -> CheckResult:
    """Greedy equivalence where token ids or the target's logits are out of reach (an endpoint that returns text
    only, or no reference build): the texts must be equal; a difference cannot be called a near-tie."""
    cfg = gate.greedy
    failures, per_prompt = [], []
    for prompt in gate.prompts:
        speculative = subject.greedy_completion(prompt, cfg.max_new_tokens, gate.num_draft_tokens)
        target_only = subject.greedy_completion(prompt, cfg.max_new_tokens, 0)
        tick(1)
        a, b = speculative.text, target_only.text
        ids = speculative.token_ids is not None and target_only.token_ids is not None
        match = speculative.token_ids == target_only.token_ids if ids else a == b
        entry = {"prompt": prompt, "match": match, "compared": "token ids" if ids else "text", "chars": len(b)}
        per_prompt.append(entry)
        if not match:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            entry.update(position_char=at, speculative=a, target_only=b)
            failures.append(f"prompt {prompt!r}: the outputs differ from character {at}: speculative {a[at:at + 24]!r} "
                            f"!= target-only {b[at:at + 24]!r}")
    matched = sum(e["match"] for e in per_prompt)
    warnings = ["no near-tie rule: the target's logits are not available here, so any difference fails"] if failures else []
    metrics = {"prompts": len(per_prompt), "matched": matched, "near_ties": 0, "real_mismatches": len(failures),
               "max_new_tokens": cfg.max_new_tokens, "compared": sorted({e["compared"] for e in per_prompt}),
               "per_prompt": per_prompt}  # fmt: skip
    summary = f"{matched}/{len(per_prompt)} prompts identical ({', '.join(metrics['compared'])}), {len(failures)} differ"
    return CheckResult(NAME, "failed" if failures else "passed", summary, failures, warnings, metrics)
