"""Read a gate file (TOML) into a GateConfig. Strict: an unknown key or a bad value is one GateError
that lists every problem, with the key's dotted path (e.g. `latency.ttft_p50_max: unknown key`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from pydantic import ValidationError

from specpipe.errors import GateError
from specpipe.gate.config import GateConfig

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def load_gate(path: Optional[str | Path]) -> GateConfig:
    """The gate in `path`, or the default gate (GateConfig()) when path is None."""
    if path is None:
        return GateConfig()
    path = Path(path)
    if not path.is_file():
        raise GateError(f"gate file not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise GateError(f"{path} is not valid TOML: {exc}") from None
    try:
        return GateConfig.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"])
            problems.append(f"{key}: unknown key" if err["type"] == "extra_forbidden" else f"{key}: {err['msg']}")
        raise GateError(f"{path}: " + "; ".join(problems)) from None
