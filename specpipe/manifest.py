"""engines/<name>/manifest.json: what was built, from what, with which versions, and how it checked out."""

from __future__ import annotations

import hashlib
import json
import platform
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from specpipe import __version__
from specpipe.errors import EngineError

MANIFEST = "manifest.json"
FORMAT = 1
_LIBRARIES = ["torch", "transformers", "optimum-onnx", "onnx", "onnxruntime", "numpy", "tritonclient", "nvidia-pytriton"]


def library_versions(libraries=tuple(_LIBRARIES)) -> dict[str, str]:
    versions = {"python": platform.python_version(), "specpipe": __version__}
    for lib in libraries:
        try:
            versions[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            pass
    return versions


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(Path(folder).iterdir()) if p.is_file()}


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_manifest(folder: Path, manifest: dict) -> None:
    manifest = {"format": FORMAT, **manifest}
    (Path(folder) / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n")


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST
    if not Path(folder).is_dir():
        raise EngineError(f"no such engine folder: {folder}")
    if not path.is_file():
        raise EngineError(f"{folder} is not a specpipe build (no {MANIFEST}); run `specpipe build` first")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise EngineError(f"{path} is not valid JSON: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise EngineError(f"{path} has format {manifest.get('format')!r}; this specpipe reads format {FORMAT}")
    return manifest
