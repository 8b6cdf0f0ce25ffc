"""No draft: the target alone decodes every request (`--draft none`, or what `build` deploys when no candidate made
decoding faster)."""

from __future__ import annotations

from typing import ClassVar, Literal

from specpipe.contract.decoding import DecodingPolicy
from specpipe.contract.manifest import DraftEntry
from specpipe.drafts.base import DraftKind


class NoDecoding(DecodingPolicy):
    """Nothing to draft: every request decodes target-only, whatever K it asks for."""


class NoDraft(DraftEntry):
    kind: Literal["none"] = "none"
    source: str = "none"
    policy: ClassVar = NoDecoding


class NoneKind(DraftKind):
    name = "none"
    entry = NoDraft

    @classmethod
    def claims(cls, spec):
        return spec == "none"

    @classmethod
    def drafter(cls, folder, entry, target, threads):
        return None

    @classmethod
    def build(cls, spec, out, ctx):
        return NoDraft(kind="none", source="none")

    @classmethod
    def describe(cls, entry):
        return ["none: the target alone decodes every request"]
