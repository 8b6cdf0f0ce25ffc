"""One step of a GPU plan: a command line, a Python call, or files specpipe writes.

A plan is data: `specpipe build --dry-run` prints it, tests inspect it, and the runner executes the same
objects, so what is printed is what runs.
"""

from __future__ import annotations

import shlex
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict

# What a step needs on the machine that runs it (specpipe/build/run.py missing_requirements checks each key).
Need = Literal["cuda", "tensorrt", "tensorrt_llm", "trtllm-build", "trtllm-checkout", "modelopt", "modelopt-checkout", "hub"]


class Step(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str  # "target.quantize", "draft.engine", ...
    title: str
    kind: Literal["command", "python", "write"]
    argv: tuple[str, ...] = ()  # kind "command"
    call: Optional[str] = None  # kind "python": dotted name of the function called
    kwargs: dict[str, Any] = {}  # kind "python": its arguments (JSON values)
    writes: tuple[str, ...] = ()  # files and folders the step creates
    needs: tuple[Need, ...] = ()
    gpu: bool = False  # runs on a GPU: a real build stops before the first such step when none is usable
    source: str = ""  # the upstream file that defines the command or API

    def display(self) -> str:
        """The step as a person would type or read it."""
        if self.kind == "command":
            return shlex.join(self.argv)
        if self.kind == "python":
            args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
            return f"{self.call}({args})"
        return "write " + ", ".join(self.writes)
