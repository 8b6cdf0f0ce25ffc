"""Greedy equivalence, defined once for the tests and the gate: is speculative output the target's own?

Rule. The speculative and the target-only greedy token ids must be identical, except that a first
divergence is allowed where the target-only run was at a near-tie: the target's top-2 logits at that
position, as the target-only run computed them, are within `tolerance` of each other. After an allowed
divergence the two outputs are compared no further (they now continue different texts).

Why a tolerance at all: a verify call scores K+1 positions at once and a target-only step scores one, and
CPU kernels take other code paths for one row than for several, so the same position's logits can differ
in the last bits; where the top two are that close, either token is the target's "own". A build runs the
target's 1-token steps as 2-row calls, which makes the two bit-identical (engines/onnxruntime.py), so
for such a target no divergence is expected at all; the tolerance covers engines that only promise fp32 rounding
(older builds, other backends). A bug in the acceptance rule changes tokens whose margin is far larger.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np

from specpipe.engines.base import Engine

# Largest top-2 logit margin (target-only run) at which a first divergence counts as a near-tie, by the
# target engine's quantization mode. Measured max |decode - verify| logit difference (engines/consistency.py,
# 2-3 prompts x 32-60 greedy tokens, K+1 = 5, AVX2 EPYC): with 1-token steps run as 2 rows (what builds do)
# 0.0 for every mode on SmolLM2-135M (fp32, int8-wo, int4-wo) and the tiny test model (also int8 W8A8,
# fp8), and 0.0 between 1 and 2 threads. Unpadded: fp32 7.3e-5 (SmolLM2) / 4.3e-6 (tiny): 2x that with a
# ~6x margin gives 1e-3. Unpadded int8-wo / int4-wo (MatMulNBits accuracy_level 4) move logits by up to
# 1.8 on SmolLM2: no tolerance can call that a near-tie; the build flags such a target (verify_consistency
# in the manifest) and the gate reports it, instead of widening the rule.
NEAR_TIE_TOLERANCE = {"none": 1e-3, "int8-wo": 1e-3, "int4-wo": 1e-3, "int8": 1e-3, "fp8": 1e-3}


def near_tie_tolerance(quant_mode: str) -> float:
    """The near-tie tolerance for a target engine quantized as `quant_mode` (the manifest's engine.quant)."""
    return NEAR_TIE_TOLERANCE.get(quant_mode, max(NEAR_TIE_TOLERANCE.values()))


@dataclass(frozen=True)
class Divergence:
    """The first position where the two greedy outputs differ, and whether the target was at a near-tie."""

    position: int  # index into the generated tokens
    speculative_token: Optional[int]  # None: that output ended before `position`
    target_only_token: Optional[int]
    target_argmax: int  # the target-only run's argmax at `position` (replayed)
    top2_margin: float  # its largest minus second largest logit there
    speculative_gap: Optional[float]  # its largest logit minus the speculative token's (None: no token)
    tolerance: float

    @property
    def near_tie(self) -> bool:
        """The target's top two were within tolerance, and the speculative token is one of the tied ones
        (a wrong rule that emits an unrelated token at a chance near-tie still fails)."""
        tied_token = self.speculative_gap is None or self.speculative_gap <= self.tolerance
        return self.top2_margin <= self.tolerance and tied_token

    def as_dict(self) -> dict:
        return {**asdict(self), "near_tie": self.near_tie}


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """First index where a and b differ (or where the shorter one ends); None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def target_only_logits(target: Engine, prompt_ids: Sequence[int], target_only: Sequence[int], position: int) -> np.ndarray:
    """[V] the logits the target-only run used to choose token `position`, recomputed the way it ran:
    the prompt in one call, then one generated token per call (SpeculativeDecoder with nothing drafted)."""
    sequence = target.new_sequence()
    logits = sequence.append(list(prompt_ids), last=1)[-1]
    for token in target_only[:position]:
        logits = sequence.append([token])[-1]
    return logits


def compare_greedy(
    target: Engine,
    prompt_ids: Sequence[int],
    speculative: Sequence[int],
    target_only: Sequence[int],
    tolerance: float,
) -> Optional[Divergence]:
    """None when the outputs are identical; else their first divergence (check `.near_tie`)."""
    position = first_difference(speculative, target_only)
    if position is None:
        return None
    logits = np.asarray(target_only_logits(target, prompt_ids, target_only, position), dtype=np.float64)  # [V]
    second, first = np.partition(logits, -2)[-2:]
    speculative_token = _at(speculative, position)
    return Divergence(
        position=position,
        speculative_token=speculative_token,
        target_only_token=_at(target_only, position),
        target_argmax=int(np.argmax(logits)),
        top2_margin=float(first - second),
        speculative_gap=None if speculative_token is None else float(first - logits[speculative_token]),
        tolerance=tolerance,
    )


def _at(ids: Sequence[int], position: int) -> Optional[int]:
    return int(ids[position]) if position < len(ids) else None
