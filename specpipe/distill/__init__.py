"""Distillation: make a small draft for a target that has no small sibling, on CPU, from the target's own answers.

    distill(DistillConfig(target="smollm2-135m", out=Path("drafts/smol")))  -> DistillResult(path, record)

Stages: teacher data (target answers with top-k probabilities, cached) -> student (a narrow Llama whose
embedding is the target's, projected) -> training (soft cross-entropy over a candidate set) -> checkpoint.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Optional

from specpipe.distill.progress import DistillProgress, RichDistillProgress, SilentProgress

if TYPE_CHECKING:
    from specpipe.distill.config import DistillConfig
    from specpipe.distill.run import DistillResult


def __getattr__(name: str) -> Any:  # importing the package (for its config, say) loads no trainer
    if name == "DistillResult":
        return importlib.import_module("specpipe.distill.run").DistillResult
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def distill(cfg: DistillConfig, progress: Optional[DistillProgress] = None) -> DistillResult:
    """Train what `cfg.kind` names for cfg.target and write it to cfg.out: a small draft model (run.py) or an
    EAGLE-3 head (eagle3_run.py)."""
    from specpipe.distill.eagle3_run import distill_eagle3
    from specpipe.distill.run import distill_model

    train = distill_eagle3 if cfg.kind == "eagle3" else distill_model
    return train(cfg, progress or SilentProgress())

__all__ = ["DistillProgress", "DistillResult", "RichDistillProgress", "SilentProgress", "distill"]
