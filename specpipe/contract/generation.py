"""One request's settings: how a next-token distribution is shaped (p and q alike) and how a request
decodes. Every stage that runs a deployment speaks these (speculative, triton, gate, bench)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from specpipe.config import Strict


BenchPromptSet = Literal["code", "chat", "grounded"]  # the packaged prompt sets (specpipe/bench/prompts)


class SamplingConfig(Strict):
    """How a next-token distribution is shaped. Applied identically to target (p) and draft (q).

    temperature == 0 means greedy (argmax); top_k == 0 and top_p == 1.0 mean "off".
    """

    temperature: float = Field(0.0, ge=0.0, description="0 = greedy")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = off")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass to keep, in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class GenerationConfig(Strict):
    """One request: sampling, lengths, stopping, speculation."""

    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    max_new_tokens: int = Field(128, ge=1)
    num_draft_tokens: int = Field(4, ge=1, description="K: tokens the draft proposes per step (the first K when adaptive)")
    draft_length: Literal["adaptive", "heuristic", "fixed"] = Field(
        "adaptive",
        description="adaptive: each step drafts the K of highest expected speedup for this request's acceptance "
        "and the engines' measured costs, and a model draft stops when unsure; heuristic: transformers' "
        "+2/-1 schedule; fixed: always num_draft_tokens",
    )
    max_draft_tokens: int = Field(16, ge=1, description="adaptive K's ceiling (also capped by the build's max_draft_len)")
    min_draft_confidence: float = Field(
        0.4, ge=0.0, le=1.0, description="adaptive and heuristic: stop drafting after a token whose top draft probability is below this"
    )
    speculative: bool = True
    stop: list[str] = Field(default_factory=list, description="stop strings (checked on decoded text)")
    stop_on_eos: bool = True
    seed: Optional[int] = Field(None, ge=0, description="seed for sampling; None = nondeterministic")

    @model_validator(mode="after")
    def _adaptive_k_fits(self) -> "GenerationConfig":
        if self.draft_length != "fixed" and self.num_draft_tokens > self.max_draft_tokens:
            raise ValueError(
                f"num_draft_tokens {self.num_draft_tokens} > max_draft_tokens {self.max_draft_tokens} (adaptive K starts there)"
            )
        return self
