"""Prompt lookup (`--draft ngram`): the context's own n-grams propose the next tokens; no engine, no build step
beyond its settings."""

from __future__ import annotations

from typing import ClassVar, Literal

from specpipe.contract.decoding import DecodingPolicy
from specpipe.contract.drafts import NgramConfig
from specpipe.contract.manifest import DraftEntry
from specpipe.drafts.base import DraftKind
from specpipe.speculative.ngram import NgramDrafter


class NgramDecoding(DecodingPolicy):
    """TensorRT-LLM's NGramDecodingConfig."""

    decoding_type = "NGram"
    backends = ("onnxruntime", "trtllm")


class NgramDraft(DraftEntry):
    """Prompt lookup: no engine."""

    kind: Literal["ngram"] = "ngram"
    source: str = "ngram"
    ngram: NgramConfig
    policy: ClassVar = NgramDecoding


class NgramKind(DraftKind):
    name = "ngram"
    entry = NgramDraft

    @classmethod
    def claims(cls, spec):
        return spec == "ngram"

    @classmethod
    def drafter(cls, folder, entry, target, threads):
        return NgramDrafter.from_config(entry.ngram)

    @classmethod
    def build(cls, spec, out, ctx):
        return NgramDraft(kind="ngram", source="ngram", ngram=ctx.cfg.ngram)

    @classmethod
    def describe(cls, entry):
        return [f"prompt lookup (n-grams {entry.ngram.ngram_min}..{entry.ngram.ngram_max})"]
