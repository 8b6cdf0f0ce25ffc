"""What a draft kind is: the four things a kind owns, and what `build` hands a kind's build step.

A kind (one module beside this one) names its `--draft` values (`claims`), its manifest entry (a
contract.manifest.DraftEntry subclass), its decoding policy (a contract.decoding.DecodingPolicy subclass), how a
deployment makes its proposer (`drafter`) and how `build` makes its files (`build`). vLLM picks a proposer by
`SpeculativeConfig.method` (vllm/v1/spec_decode/: one proposer per file); this is the same registry, one level up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

from specpipe.contract.manifest import DraftEntry, ModelEntry
from specpipe.engines import Engine
from specpipe.speculative.drafters import Drafter


@dataclass
class BuildContext:
    """What builder/cpu.py hands a kind's build step: the build's config (builder.config.BuildConfig), the stage
    folder holding the target's engines, and the builder's own steps a kind may call. The build step sits in
    its kind's module below the builder, so the builder passes these rather than being imported."""

    cfg: Any  # builder.config.BuildConfig
    stage: Path  # the target's engines: stage/target (and stage/target-fp32 when --quant quantized it)
    target: Any  # the resolved target checkpoint (checkpoint.ResolvedCheckpoint)
    target_entry: ModelEntry
    tokenizer: Any
    say: Callable[[str], None]
    timings: dict[str, float]  # what the step spent, by name (seconds)
    checkpoint: Any = None  # the resolved draft checkpoint (kinds with `has_checkpoint`)
    vocab: Optional[dict] = None  # the draft head's columns (checkpoint/draft_vocab.py), or None for all
    feature_layers: Optional[tuple[int, ...]] = None  # the target layers its engine outputs (kinds that read them)
    # The builder's own steps (builder/cpu.py), for a kind that exports a checkpoint as the target is exported:
    export: Optional[Callable[..., ModelEntry]] = None  # _build_engine: export, check against torch, quantize
    draft_graph: Optional[Callable[..., tuple[str, Optional[str]]]] = None  # which exporter makes a draft model


class DraftKind:
    """One draft kind. Subclasses set `name`, `entry` and `policy` and override `claims`, `drafter` and `build`."""

    name: ClassVar[str]
    entry: ClassVar[type[DraftEntry]]  # its record in the manifest
    has_engine: ClassVar[bool] = False  # drafts with a model of its own: a step that costs time, so it can slow decoding
    has_checkpoint: ClassVar[bool] = False  # a checkpoint `build` resolves and checks against the target first
    reads_target_features: ClassVar[bool] = False  # the target engine must output hidden states for it

    @classmethod
    def claims(cls, spec: str) -> bool:
        """Whether a --draft value names this kind."""
        raise NotImplementedError

    @classmethod
    def drafter(cls, folder: Path, entry: DraftEntry, target: Engine, threads: int) -> Optional[Drafter]:
        """The proposer for a deployment in `folder` (None: the target decodes alone)."""
        raise NotImplementedError

    @classmethod
    def build(cls, spec: str, out: Path, ctx: BuildContext) -> DraftEntry:
        """Build this --draft value's files in `out` (an engine in out/draft); the entry's paths are relative to `out`."""
        raise NotImplementedError

    @classmethod
    def describe(cls, entry: DraftEntry) -> list[str]:
        """`build`'s summary lines for it."""
        return [f"{cls.name} {entry.source}"]
