"""What every config shares: the strict base model, thread and length limits, and the helpers the CLI builds
configs and reads their defaults with. Each stage's own config lives beside it (builder/, gate/, distill/,
bench/); the types that pass between stages live in specpipe/contract/."""

from __future__ import annotations

import os
from typing import Annotated, Literal, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


# Intra-op threads of ONNX Runtime (and torch) wherever none are given: the measurements in docs/ use 2.
THREADS = 2
# The most any command takes: past a few per CPU, threads only wait on each other (--threads 100000 hung
# ONNX Runtime's session start for minutes before anything was printed).
MAX_THREADS = 4 * (os.cpu_count() or 1)
THREADS_HELP = f"ONNX Runtime intra-op threads (1 to {MAX_THREADS}: 4 per CPU of this machine)"


def _threads_fit_this_machine(threads: int) -> int:
    if threads > MAX_THREADS:
        raise ValueError(f"{threads} is more than {MAX_THREADS} (4 per CPU of this machine): more only wait on each other")
    return threads


Threads = Annotated[int, Field(ge=1), AfterValidator(_threads_fit_this_machine)]
# A build's folder name (--name): it becomes a path and a word in commands people paste into a shell.
NAME_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,127}"
# The longest sequence an engine is built for when the model's context is longer (or --max-seq-len not given).
MAX_SEQ_LEN = 8192


class RuntimeConfig(Strict):
    """How a deployment's engines run in this process (`generate ENGINE_DIR`, `validate`'s in-process engines)."""

    threads: Threads = Field(THREADS, description=THREADS_HELP)


def make_config(model: type[BaseModel], **values):
    """Build a config model; a validation failure becomes one UsageError line naming the CLI option."""
    from pydantic import ValidationError

    from specpipe.errors import UsageError

    try:
        return model(**values)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            names = [part for part in err["loc"] if isinstance(part, str)]
            if names[:1] == ["backend"] and len(names) > 2:  # backend, its kind, the field: the option is the field's
                if err["type"] == "extra_forbidden":
                    problems.append(f"--{names[2].replace('_', '-')} does not apply to --backend {names[1]}")
                    continue
                names = names[2:]
            message = err["msg"].removeprefix("Value error, ")
            problems.append(f"--{'-'.join(names).replace('_', '-')}: {message}" if names else message)
        raise UsageError("; ".join(problems)) from None


def field_default(model: type[BaseModel], name: str):
    """The default of a config field, for click options (so help text and behaviour cannot drift)."""
    return model.model_fields[name].get_default(call_default_factory=True)


def field_help(model: type[BaseModel], name: str) -> str:
    return model.model_fields[name].description or ""


def field_choices(model: type[BaseModel], name: str) -> list[str]:
    """The values of a Literal field (or of a list or Optional of one), for click.Choice."""
    annotation = model.model_fields[name].annotation
    while get_origin(annotation) is not Literal:
        annotation = next(arg for arg in get_args(annotation) if arg is not type(None))
    return list(get_args(annotation))
