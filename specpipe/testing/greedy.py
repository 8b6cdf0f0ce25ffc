"""The greedy-equivalence rule (speculative/equivalence.py) as a test assertion on a deployment."""

from __future__ import annotations

from typing import Sequence

from specpipe.speculative.equivalence import Divergence, compare_greedy, near_tie_tolerance


def assert_greedy_equivalent(deployment, prompt: str | Sequence[int], speculative: Sequence[int],
                             target_only: Sequence[int], *, chat: bool = False) -> Divergence | None:
    """Fail unless `speculative` equals `target_only` up to a first divergence at a near-tie of the
    deployment's target (tolerance from its precision). Returns that divergence, or None if identical."""
    prompt_ids = deployment.generator.encode(prompt, chat) if isinstance(prompt, str) else list(prompt)
    tolerance = near_tie_tolerance(deployment.manifest.target.engine.quant)
    divergence = compare_greedy(deployment.target, prompt_ids, speculative, target_only, tolerance)
    assert divergence is None or divergence.near_tie, f"greedy outputs differ beyond a near-tie: {divergence}"
    return divergence
