"""`specpipe validate`'s gate file (TOML), as typed sections."""

from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator, model_validator

from specpipe.config import Strict


# ---- `specpipe validate`: the gate file (TOML). Every section and key is optional; a missing latency
# threshold means "report only". docs/gate.md documents these keys.
_GATE_PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Explain what a hash table is in two sentences.",
    "import numpy as np\n\n",
    "Once upon a time, in a small village,",
    "Write a Python function that reverses a string.",
]


_GATE_CONTEXTS = ["The capital of France is", "import numpy as"]  # uncertain next token, not flat


class GateGreedyConfig(Strict):
    """Greedy equivalence: speculative token ids == target-only token ids, prompt by prompt."""

    enabled: bool = True
    max_new_tokens: int = Field(32, ge=1)
    near_tie_margin: Optional[float] = Field(
        None, ge=0,
        description="a first mismatch where the target's top-2 logit margin is within this is a warning, not a failure;"
        " None = the tolerance of the target's precision (speculative/equivalence.py)",
    )


class GateDistributionConfig(Strict):
    """Distribution equivalence: the first two emitted tokens follow the target's exact p (chi-square)."""

    enabled: bool = True
    contexts: list[str] = Field(default_factory=lambda: list(_GATE_CONTEXTS), min_length=1)
    temperatures: list[float] = Field(default_factory=lambda: [1.0, 0.7], min_length=1)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    draft_lengths: list[int] = Field(
        default_factory=lambda: [1, 2], min_length=1,
        description="K per sample, round robin: K=1 puts the bonus token at position 2, K=2 a second draft",
    )
    tv: float = Field(0.05, gt=0.0, lt=1.0, description="total-variation error the test must detect")
    alpha: float = Field(1e-3, gt=0.0, lt=1.0, description="family-wise false-alarm rate (Bonferroni over all tests)")
    power: float = Field(0.99, gt=0.0, lt=1.0, description="probability of detecting an error of size tv")
    min_expected: float = Field(5.0, gt=0.0, description="bins expecting fewer samples are pooled")
    max_bins: int = Field(32, ge=2, description="most effective bins per test (likeliest tokens; the rest pooled)")
    max_samples: int = Field(20000, ge=10, description="cap on in-process samples per (context, temperature)")
    server_samples: int = Field(1500, ge=10, description="samples per (context, temperature) through a server")
    planted_replicates: int = Field(200, ge=1, description="replicates of the planted wrong sampler")
    planted_power_min: float = Field(0.9, gt=0.0, le=1.0, description="share of planted replicates that must fail")
    seed: int = 0

    @field_validator("temperatures")
    @classmethod
    def _positive_temperatures(cls, v: list[float]) -> list[float]:
        if any(t <= 0 for t in v):
            raise ValueError("temperatures must be > 0 (greedy decoding is the greedy check's job)")
        return v

    @field_validator("draft_lengths")
    @classmethod
    def _positive_draft_lengths(cls, v: list[int]) -> list[int]:
        if any(k < 1 for k in v):
            raise ValueError("draft_lengths must be >= 1")
        return v


class GateQuantizationConfig(Strict):
    """Quantization accuracy (keys as in AccuracyBudget). A budget left out is the one the build recorded."""

    enabled: bool = True
    max_ppl_increase: Optional[float] = Field(None, ge=0.0, description="relative perplexity increase, 0.05 = +5%")
    min_top1_agreement: Optional[float] = Field(None, ge=0.0, le=1.0)
    max_mean_kl: Optional[float] = Field(None, gt=0.0, description="mean KL(unquantized || quantized), nats")


class GateLatencyConfig(Strict):
    """Latency and speed SLOs. Each threshold left out (None) is reported, not enforced."""

    enabled: bool = True
    concurrency: int = Field(2, ge=1, description="users in flight at once: the concurrency the SLO holds at")
    requests: int = Field(8, ge=1, description="measured requests per configuration (speculative, target-only)")
    warmup_requests: int = Field(2, ge=0, description="requests run first and not measured")
    max_new_tokens: int = Field(64, ge=2)
    ttft_ms_p50_max: Optional[float] = Field(None, gt=0.0)
    ttft_ms_p95_max: Optional[float] = Field(None, gt=0.0)
    itl_ms_p50_max: Optional[float] = Field(None, gt=0.0)
    itl_ms_p95_max: Optional[float] = Field(None, gt=0.0)
    tokens_per_s_min: Optional[float] = Field(None, gt=0.0)
    speedup_min: Optional[float] = Field(None, gt=0.0)
    acceptance_rate_min: Optional[float] = Field(None, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _every_user_sends(self) -> "GateLatencyConfig":
        # Through a server the runs are specpipe.bench.load levels: fewer requests than users is a lower concurrency.
        if self.requests < self.concurrency:
            raise ValueError(f"requests {self.requests} < concurrency {self.concurrency}: the SLO would be measured at a lower load")
        return self


class GateRobustnessConfig(Strict):
    """Bad requests are refused with clear errors and the server still answers (server modes only)."""

    enabled: bool = True


class GateConfig(Strict):
    """A gate file: `specpipe validate --gate FILE`. GateConfig() is the default gate."""

    prompts: list[str] = Field(default_factory=lambda: list(_GATE_PROMPTS), min_length=1,
                               description="prompts of the greedy and latency checks")
    chat: bool = Field(False, description="apply the tokenizer's chat template to prompts and contexts")
    num_draft_tokens: int = Field(4, ge=1, description="K of the greedy and latency checks")
    greedy: GateGreedyConfig = Field(default_factory=GateGreedyConfig)
    distribution: GateDistributionConfig = Field(default_factory=GateDistributionConfig)
    quantization: GateQuantizationConfig = Field(default_factory=GateQuantizationConfig)
    latency: GateLatencyConfig = Field(default_factory=GateLatencyConfig)
    robustness: GateRobustnessConfig = Field(default_factory=GateRobustnessConfig)
