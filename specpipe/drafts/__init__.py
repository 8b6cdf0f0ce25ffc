"""The draft kinds, one module each, and the registry that picks one by name or by --draft value.

Adding a kind is one new module (its entry, its decoding policy, its proposer, its build step: drafts/base.py
says what a kind owns) and one line in KINDS. Every stage after the build reaches kinds through this registry:
`read_manifest` types the manifest's draft by its kind, `make_drafter` opens its proposer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from specpipe.contract.manifest import DraftEntry, Manifest
from specpipe.contract.manifest import read_manifest as _read_manifest
from specpipe.drafts import eagle3, model, ngram, none, self_draft
from specpipe.drafts.base import BuildContext, DraftKind
from specpipe.engines import Engine
from specpipe.errors import UsageError
from specpipe.speculative.drafters import Drafter

# By name; a --draft value is the first kind here that claims it, so the catch-all (a checkpoint: model) is last.
KINDS: dict[str, type[DraftKind]] = {kind.name: kind for kind in (
    none.NoneKind,
    ngram.NgramKind,
    self_draft.SelfKind,
    eagle3.Eagle3Kind,
    model.ModelKind,
)}

__all__ = ["KINDS", "BuildContext", "DraftKind", "kind_named", "kind_of", "make_drafter", "manifest_of", "read_manifest",
           "register"]


def register(kind: type[DraftKind]) -> type[DraftKind]:
    """Add a kind ahead of the catch-all (a plug-in, or a test's toy kind)."""
    if kind.name in KINDS:
        raise ValueError(f"draft kind {kind.name!r} is registered already")
    *claimed, catch_all = KINDS.items()
    KINDS.clear()
    KINDS.update([*claimed, (kind.name, kind), catch_all])
    return kind


def kind_named(name: str) -> type[DraftKind]:
    if name not in KINDS:
        raise UsageError(f"no draft kind {name!r}; this specpipe knows {', '.join(KINDS)}")
    return KINDS[name]


def kind_of(spec: str) -> type[DraftKind]:
    """The kind a --draft value names: `none`, `ngram`, `self:MODE`, a folder holding an EAGLE-3 head, else a
    checkpoint (a draft model)."""
    return next(kind for kind in KINDS.values() if kind.claims(spec))


def read_manifest(folder: Path | str) -> Manifest:
    """engines/<name>/manifest.json, its draft typed by its kind."""
    return _read_manifest(Path(folder), draft_entries=_entries())


def manifest_of(data: dict[str, Any]) -> Manifest:
    """A manifest from its JSON values (as Manifest.as_dict writes them), its draft typed by its kind."""
    return Manifest.model_validate(data, context={"draft_entries": _entries()})


def _entries() -> dict[str, type[DraftEntry]]:
    return {name: kind.entry for name, kind in KINDS.items()}


def make_drafter(folder: Path, draft: DraftEntry, target: Engine, threads: int) -> Optional[Drafter]:
    """The proposer the manifest's `draft` describes (None: the target decodes alone)."""
    return kind_named(draft.kind).drafter(folder, draft, target, threads)
