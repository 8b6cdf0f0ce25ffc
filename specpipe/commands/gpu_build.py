"""The GPU half of `specpipe build`: --backend tensorrt|trtllm, --dry-run, --tp-size, --gpu-memory-gb.

`gpu_options` adds the options to the build command (defaults from GpuBuildConfig); `gpu_build` turns them
into a GpuBuildConfig, makes the plan, prints it (or its JSON), writes the Triton repository on --dry-run,
and runs the plan otherwise. The CPU build is untouched when --backend is onnxruntime (the default).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from specpipe.config import GpuBuildConfig, field_default, field_help, make_config
from specpipe.errors import UsageError

_QUANT_CHOICES = ["none", "int8-wo", "int4-wo", "int8", "fp8"]

_OPTIONS = [
    click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt", "trtllm"]), default="onnxruntime", show_default=True,
                 help="onnxruntime: CPU engines; tensorrt: TensorRT engines from the ONNX graphs; trtllm: TensorRT-LLM (multi-GPU)."),
    click.option("--trtllm-flow", type=click.Choice(["engine", "llmapi"]), default=field_default(GpuBuildConfig, "trtllm_flow"),
                 show_default=True, help=field_help(GpuBuildConfig, "trtllm_flow")),
    click.option("--tp-size", type=int, default=field_default(GpuBuildConfig, "tp_size"), show_default=True,
                 help=field_help(GpuBuildConfig, "tp_size")),
    click.option("--draft-tp-size", type=int, default=field_default(GpuBuildConfig, "draft_tp_size"), show_default=True,
                 help=field_help(GpuBuildConfig, "draft_tp_size")),
    click.option("--draft-placement", type=click.Choice(["shared", "separate"]), default=field_default(GpuBuildConfig, "draft_placement"),
                 show_default=True, help=field_help(GpuBuildConfig, "draft_placement")),
    click.option("--gpu-memory-gb", type=float, default=None, help=field_help(GpuBuildConfig, "gpu_memory_gb")),
    click.option("--max-batch-size", type=int, default=field_default(GpuBuildConfig, "max_batch_size"), show_default=True,
                 help=field_help(GpuBuildConfig, "max_batch_size")),
    click.option("--max-input-len", type=int, default=field_default(GpuBuildConfig, "max_input_len"), show_default=True,
                 help=field_help(GpuBuildConfig, "max_input_len")),
    click.option("--max-seq-len", type=int, default=None, help=field_help(GpuBuildConfig, "max_seq_len")),
    click.option("--dtype", type=click.Choice(["float16", "bfloat16"]), default=field_default(GpuBuildConfig, "dtype"),
                 show_default=True, help=field_help(GpuBuildConfig, "dtype")),
    click.option("--trtllm-checkout", type=click.Path(path_type=Path), default=field_default(GpuBuildConfig, "trtllm_checkout"),
                 show_default=True, help=field_help(GpuBuildConfig, "trtllm_checkout")),
    click.option("--modelopt-checkout", type=click.Path(path_type=Path), default=field_default(GpuBuildConfig, "modelopt_checkout"),
                 show_default=True, help=field_help(GpuBuildConfig, "modelopt_checkout")),
    click.option("--dry-run", is_flag=True, help="GPU backends: print the plan and write the Triton repository; build nothing."),
]
# Offered here only when the build command does not declare them itself (the quantization options).
_QUANT_OPTIONS = {
    "quant": click.option("--quant", type=click.Choice(_QUANT_CHOICES), default="none", show_default=True,
                          help="Target quantization (GPU backends: fp8, int8 = int8_sq, int4-wo = int4_awq, int8-wo)."),
    "draft_quant": click.option("--draft-quant", type=click.Choice(_QUANT_CHOICES), default="none", show_default=True,
                                help="Draft quantization."),
    "kv_cache_dtype": click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8", "int8"]), default="auto", show_default=True,
                                   help="KV cache precision."),
}  # fmt: skip
_GPU_KEYS = ("backend", "trtllm_flow", "tp_size", "draft_tp_size", "draft_placement", "gpu_memory_gb", "max_batch_size",
             "max_input_len", "max_seq_len", "dtype", "trtllm_checkout", "modelopt_checkout", "dry_run")  # fmt: skip


def gpu_options(command):
    """Decorator (place it right under @click.command()): adds the GPU options to the build command."""
    declared = {param.name for param in getattr(command, "__click_params__", [])}
    added = [name for name in _QUANT_OPTIONS if name not in declared]
    for name in added:
        command = _QUANT_OPTIONS[name](command)
    for option in reversed(_OPTIONS):
        command = option(command)
    command._gpu_added_quant_options = tuple(added)  # popped again before BuildConfig sees the options
    return command


def split_gpu_options(command, options: dict) -> dict:
    """Remove the GPU options from `options` (in place) and return them."""
    gpu = {key: options.pop(key) for key in _GPU_KEYS if key in options}
    callback = getattr(command, "callback", command)  # the click Command wraps the decorated function
    for key in getattr(callback, "_gpu_added_quant_options", ()):
        gpu[key] = options.pop(key)
    for key in _QUANT_OPTIONS:  # the build command's own quantization options also feed the GPU plan
        if key in options and key not in gpu:
            gpu[key] = options[key]
            _CPU_HANDLED.add(key)
    return gpu


def gpu_build(gpu: dict, options: dict, *, as_json: bool) -> None:
    """Plan (and, without --dry-run, run) a GPU build; print the plan or the result."""
    from rich.console import Console

    from specpipe.build import make_plan, render_plan, write_plan_repository
    from specpipe.build.run import run_plan

    fields = {
        "target": options["target"], "draft": options["draft"], "name": options.get("name"),
        "engines_dir": options.get("engines_dir"), "repo_dir": options.get("repo_dir"),
        "max_draft_len": options.get("max_draft_len"),
        **{k: v for k, v in gpu.items() if k in GpuBuildConfig.model_fields and v is not None},
    }  # fmt: skip
    fields = {k: v for k, v in fields.items() if v is not None or k in ("name", "repo_dir")}
    cfg = make_config(GpuBuildConfig, **fields)
    plan = make_plan(cfg)
    if cfg.dry_run:
        written = write_plan_repository(plan, cfg)
        click.echo(plan.model_dump_json(indent=2) if as_json else render_plan(plan))
        if written and not as_json:
            click.echo(f"\nwrote the Triton repository: {plan.repo_dir} ({len(written)} files; upstream model.py files are copied by the real build)")
        return
    console = Console(stderr=True)
    with console.status("building") as status:
        folder = run_plan(plan, cfg, progress=lambda msg: (status.update(msg), console.log(msg)))
    click.echo(plan.model_dump_json(indent=2) if as_json else f"built {folder} ({plan.backend}, {plan.flow})")


def backend_of(gpu: dict) -> Optional[str]:
    """The GPU backend asked for, or None for the CPU build (which refuses GPU-only options it would ignore)."""
    backend = gpu.get("backend", "onnxruntime")
    if backend != "onnxruntime":
        return backend
    if gpu.get("dry_run"):
        raise UsageError("--dry-run plans GPU builds; pass --backend tensorrt or trtllm")
    defaults = {"quant": "none", "draft_quant": "none", "kv_cache_dtype": "auto"}
    for key, default in defaults.items():
        if key in gpu and gpu[key] != default and key not in _CPU_HANDLED:
            raise UsageError(f"--{key.replace('_', '-')} {gpu[key]} is only planned for --backend tensorrt or trtllm here")
    return None


# quantization options the CPU build reads itself once BuildConfig has them (the build command declares them)
_CPU_HANDLED: set[str] = set()
