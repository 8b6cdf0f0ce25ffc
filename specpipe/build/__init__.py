"""`specpipe build`: a draft/target pair -> engines/<name>/ and its Triton repository, for every backend.

    cpu.py           ONNX Runtime engines, exported, checked and timed on this machine (the default)
    draft_choice.py  several --draft candidates measured against the target alone; the fastest is deployed
    plan.py          the GPU backends (TensorRT, TensorRT-LLM): every step, file and GPU's memory, planned
                     first, so a plan can be read and tested on a machine without a GPU
    run.py           executes a plan's steps where CUDA and the packages are present
"""

from specpipe.build.cpu import build
from specpipe.build.plan import GpuMemoryError, Plan, make_plan, render_plan, write_plan_repository

__all__ = ["GpuMemoryError", "Plan", "build", "make_plan", "render_plan", "write_plan_repository"]
