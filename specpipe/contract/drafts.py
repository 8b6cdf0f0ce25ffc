"""What a draft is, as every stage names it: its kind (from a --draft value), prompt lookup's settings, and a
batch-size -> K schedule as users write it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from specpipe.config import Strict


DraftKind = Literal["model", "ngram", "self", "eagle3", "none"]


def draft_kind(spec: str) -> DraftKind:
    """What a --draft value names by its text: prompt lookup, the target quantized, no draft, or a checkpoint
    ("model"). Whether a checkpoint folder is an EAGLE-3 head ("eagle3") only its config.json says:
    checkpoint/eagle3.py `draft_kind_of` reads it."""
    if spec in ("ngram", "none"):
        return spec
    return "self" if spec.startswith("self:") else "model"


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


def parse_draft_schedule(text: str) -> list[tuple[int, int]]:
    """'1:4,4:2,8:0' -> [(1, 4), (4, 2), (8, 0)]: batch sizes up to the bound draft K (ascending bounds)."""
    rows = []
    for part in text.split(','):
        bound, sep, k = part.strip().partition(':')
        if not sep or not bound.strip().isdigit() or not k.strip().isdigit():
            raise ValueError(f"draft schedule {text!r}: write 'batch:K' pairs, e.g. '1:4,4:2,8:0'")
        rows.append((int(bound), int(k)))
    if [b for b, _ in rows] != sorted({b for b, _ in rows}) or rows[0][0] < 1:
        raise ValueError(f'draft schedule {text!r}: batch sizes must be >= 1 and ascending')
    return rows
