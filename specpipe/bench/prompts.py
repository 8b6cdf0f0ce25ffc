"""Benchmark prompt sets: the packaged ones (code, chat, grounded) and user JSONL files.

A JSONL line is {"prompt": "...", "id"?: "...", "kind"?: "..."}. The packaged sets are the shared
benchmark prompts; the distillation prompts (specpipe.distill.prompts) are kept disjoint from them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specpipe.errors import UsageError

PACKAGED = Path(__file__).parent / "prompts"


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    prompt: str


@dataclass(frozen=True)
class PromptSet:
    name: str
    prompts: list[BenchPrompt]


def read_prompt_file(path: Path, name: str | None = None) -> PromptSet:
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise UsageError(f"--prompts {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise UsageError(f"--prompts {path}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start})") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompts.append(BenchPrompt(str(item.get("id", f"{path.stem}-{number}")), str(item["prompt"])))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UsageError(f"{path}:{number}: expected a JSON object with a \"prompt\" field") from None
    if not prompts:
        raise UsageError(f"{path} holds no prompts")
    return PromptSet(name or path.stem, prompts)


def packaged_set(name: str) -> PromptSet:
    path = PACKAGED / f"{name}.jsonl"
    if not path.is_file():
        known = sorted(p.stem for p in PACKAGED.glob("*.jsonl"))
        raise UsageError(f"unknown prompt set {name!r} (known: {', '.join(known)})")
    return read_prompt_file(path, name)


def load_prompt_sets(files: list[Path], names: list[str], max_prompts: int | None = None) -> list[PromptSet]:
    """The sets a bench runs: the files and packaged names given, or code + chat when none are."""
    sets = [packaged_set(n) for n in names] + [read_prompt_file(f) for f in files]
    if not sets:
        sets = [packaged_set("code"), packaged_set("chat")]
    if max_prompts:
        sets = [PromptSet(s.name, s.prompts[:max_prompts]) for s in sets]
    return sets
