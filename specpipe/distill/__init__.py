"""Distillation: make a small draft for a target that has no small sibling, on CPU, from the target's own answers.

    distill(DistillConfig(target="smollm2-135m", out=Path("drafts/smol")))  -> DistillResult(path, record)

Stages: teacher data (target answers with top-k probabilities, cached) -> student (a narrow Llama whose
embedding is the target's, projected) -> training (soft cross-entropy over a candidate set) -> checkpoint.
"""

from specpipe.distill.progress import DistillProgress, RichDistillProgress, SilentProgress
from specpipe.distill.run import DistillResult, distill

__all__ = ["DistillProgress", "DistillResult", "RichDistillProgress", "SilentProgress", "distill"]
