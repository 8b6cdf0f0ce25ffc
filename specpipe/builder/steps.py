"""One step of a GPU plan: a command line, a Python call, or files specpipe writes.

A plan is data: `specpipe build --dry-run` prints it, tests inspect it, and the runner executes the same
objects, so what is printed is what runs.
"""

from __future__ import annotations

import shlex
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict

# What a step needs on the machine that runs it (specpipe/builder/run.py missing_requirements checks each key).
Need = Literal["cuda", "tensorrt", "tensorrt_llm", "trtllm-build", "trtllm-checkout", "modelopt", "modelopt-checkout", "hub"]

# What a step does; the runner dispatches on it (specpipe/builder/run.py). A command runs its argv as printed;
# the Python steps name the function they call; the last four write files of specpipe's own.
StepKind = Literal[
    "command",
    "resolve", "tokenizer", "export", "quantize", "autocast", "tensorrt_engine", "llm_args", "repository_check", "model_py",
    "manifest", "repository", "serve_config", "plan",
]  # fmt: skip


class Step(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str  # "target.quantize", "draft.engine", ...: a name for people; the runner reads `kind` and `role`
    title: str
    kind: StepKind
    role: Optional[Literal["target", "draft"]] = None  # the model the step works on, if one
    argv: tuple[str, ...] = ()  # kind "command"
    call: Optional[str] = None  # a Python step: dotted name of the function called
    kwargs: dict[str, Any] = {}  # a Python step: its arguments (JSON values)
    writes: tuple[str, ...] = ()  # files and folders the step creates
    needs: tuple[Need, ...] = ()
    gpu: bool = False  # runs on a GPU: a real build stops before the first such step when none is usable
    source: str = ""  # the upstream file that defines the command or API

    def display(self) -> str:
        """The step as a person would type or read it."""
        if self.kind == "command":
            return shlex.join(self.argv)
        if self.call is not None:
            args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
            return f"{self.call}({args})"
        return "write " + ", ".join(self.writes)
