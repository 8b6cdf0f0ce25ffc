"""What drafts share across stages: prompt lookup's settings, the self-draft modes and distill's record file.
The kinds themselves (model, self, eagle3, ngram, none) are specpipe/drafts/."""

from __future__ import annotations

from pydantic import Field, model_validator

from specpipe.config import Strict


# What `specpipe distill` writes beside a draft it trained (distill/run.py): how it was made, its held-out agreement
# with the target (a build predicts the draft's speedup from it) and an EAGLE-3 head's training record.
DISTILL_RECORD = "distill.json"


# `--draft self:MODE`: weight-only modes only. A self-draft must be much cheaper than the target, and these
# are the fast CPU path (MatMulNBits) that needs no calibration data.
SELF_DRAFT_QUANTS = ("int4-wo", "int8-wo")


class NgramConfig(Strict):
    """Prompt lookup drafting: match the context's last n tokens, n from ngram_max down to ngram_min.

    Peers: transformers matches n <= 2 (`max_matching_ngram_size`), vLLM asks for `prompt_lookup_max`
    with `prompt_lookup_min` defaulting to 1.
    """

    ngram_max: int = Field(3, ge=1, description="longest n-gram to look up")
    ngram_min: int = Field(1, ge=1, description="shortest n-gram to look up")

    @model_validator(mode="after")
    def _min_le_max(self) -> "NgramConfig":
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min {self.ngram_min} > ngram_max {self.ngram_max}")
        return self
