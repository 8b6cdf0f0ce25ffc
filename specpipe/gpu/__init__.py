"""GPU backends: TensorRT engines from specpipe's ONNX graphs, and TensorRT-LLM for large models.

Everything is planned first (`make_plan(cfg) -> Plan`, `render_plan(plan)`), so a plan can be read and
tested on a machine without a GPU; `run_plan` executes it where CUDA and the packages are present.
"""

from specpipe.gpu.plan import GpuMemoryError, Plan, make_plan, render_plan, write_plan_repository

__all__ = ["GpuMemoryError", "Plan", "make_plan", "render_plan", "write_plan_repository"]
