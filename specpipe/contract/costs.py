"""What a step costs on the built engines, relative to one target step (single requests) and in ms by rows
(batched steps): measured by the builder (builder/measure.py), recorded in the manifest, read by adaptive K
and the batch planner (speculative/adaptive.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepCosts:
    """Costs relative to one target decode step (c and b of speculative/adaptive.py's module docstring)."""

    draft: float  # c: one draft step / one target step
    verify_per_token: float  # b: (target call on n+1 tokens - call on 1 token) / n / one target step
    # verify[k - 1]: a target call on 1 + k tokens / one target step, measured for k = 1 .. len(verify). A CPU's
    # cost is not linear in k: ONNX Runtime's int8 MatMulNBits works on pairs of rows, so on the Zen 4 here a call
    # on 2 tokens cost 1.08 steps and one on 3 tokens 1.25. Empty (older manifests): 1 + b k.
    verify: tuple[float, ...] = ()

    def verify_cost(self, k: int) -> float:
        """A target call that scores the last context token and k drafts, relative to one target step."""
        if k <= 0:
            return 1.0
        if k <= len(self.verify):
            return self.verify[k - 1]
        if self.verify:  # beyond the measured calls: their last, plus b per further token
            return self.verify[-1] + self.verify_per_token * (k - len(self.verify))
        return 1.0 + self.verify_per_token * k

    def step_cost(self, k: int) -> float:
        """A speculative step with k drafted tokens (k draft steps and their verification), relative to one target
        step; k = 0 is the target alone."""
        return self.verify_cost(k) + self.draft * k

    def as_dict(self) -> dict:
        return asdict(self)


# Used when a manifest carries no measurement (built before costs were recorded): values measured on a
# 2-core CPU with ONNX Runtime (docs/benchmarks.md, "Measured"); prompt lookup has no draft engine, so c = 0.
DEFAULT_VERIFY_PER_TOKEN = 0.035
DEFAULT_MODEL_DRAFT_COST = 0.12


@dataclass(frozen=True)
class BatchCosts:
    """What a step costs when several requests decode together (continuous batching), in ms, measured at
    build on the target engine: `decode_ms[n]` = one batched call that appends one token to each of n rows;
    `verify_ms` = a lone row's call on 1 + k tokens is decode_ms[1] * (1 + b k), with b = StepCosts's
    verify_per_token, and a draft step costs decode_ms[1] * c. Sizes between measured ones interpolate,
    beyond the largest extrapolate from the last two."""

    decode_ms: dict[int, float]

    def decode(self, rows: int) -> float:
        if rows <= 0:
            return 0.0
        sizes = sorted(self.decode_ms)
        if rows in self.decode_ms:
            return self.decode_ms[rows]
        below = [n for n in sizes if n < rows]
        above = [n for n in sizes if n > rows]
        lo, hi = (below[-1], above[0]) if below and above else (sizes[-2], sizes[-1]) if len(sizes) > 1 else (sizes[0], sizes[0])
        if lo == hi:
            return self.decode_ms[lo] * rows / lo
        slope = (self.decode_ms[hi] - self.decode_ms[lo]) / (hi - lo)
        return self.decode_ms[lo] + slope * (rows - lo)

    def as_dict(self) -> dict:
        return {"decode_ms": {str(n): ms for n, ms in sorted(self.decode_ms.items())}}

    @classmethod
    def from_dict(cls, data: dict) -> "BatchCosts":
        return cls({int(n): float(ms) for n, ms in data["decode_ms"].items()})

    @classmethod
    def unbatched(cls, step_ms: float = 1.0) -> "BatchCosts":
        """An engine without batched calls: n rows cost n lone steps."""
        return cls({1: step_ms, 2: 2 * step_ms})
