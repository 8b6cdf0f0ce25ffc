"""`specpipe build`: a draft/target pair -> engines/<name>/ and its Triton repository, for every backend.

    cpu.py           --backend onnxruntime: engines exported, checked and timed on this machine (the default)
    measure.py       what a build measures on the engines it built: step and batch costs (adaptive K's inputs),
                     the target's rows per call, several --draft candidates against the target alone
    draft_choice.py  which candidate is deployed: the fastest, or none
    plan.py          the GPU backends (TensorRT, TensorRT-LLM): every step, file and GPU's memory, planned
                     first, so a plan can be read and tested on a machine without a GPU
    run.py           executes a plan's steps where CUDA and the packages are present
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from specpipe.builder.config import BuildConfig
    from specpipe.builder.cpu import Progress
    from specpipe.builder.plan import Plan

# Importing the package (for its config, say) loads no builder: the CLI's startup stays small. The names below
# load their module when first used.
_LAZY = {"GpuMemoryError": "plan", "Plan": "plan", "render_plan": "plan", "write_plan_repository": "plan",
         "run_plan": "run"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"specpipe.builder.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GpuMemoryError", "Plan", "build", "make_plan", "render_plan", "run_plan", "write_plan_repository"]


def make_plan(cfg: BuildConfig) -> Plan:
    """The GPU build's plan (builder/plan.py); a TensorRT-LLM plan also holds the manifest its build writes last."""
    from specpipe.builder import plan as _plan
    from specpipe.builder.trtllm_manifest import plan_manifest

    plan = _plan.make_plan(cfg)
    if cfg.backend.kind == "trtllm":
        plan = plan.model_copy(update={"manifest": plan_manifest(plan, cfg)})
    return plan


def build(cfg: BuildConfig, progress: Optional[Progress] = None) -> Path:
    """Build the pair with `cfg.backend`; returns engines/<name>. A GPU backend runs its plan (a dry run writes the
    plan's Triton repository and runs no step)."""
    if cfg.backend.kind == "onnxruntime":
        from specpipe.builder.cpu import build_cpu

        return build_cpu(cfg, progress)
    from specpipe.builder.plan import write_plan_repository
    from specpipe.builder.run import run_plan

    plan = make_plan(cfg)
    if cfg.backend.dry_run:
        write_plan_repository(plan, cfg)
        return Path(plan.work_dir)
    return run_plan(plan, cfg, progress)
