"""Execute a GPU plan where CUDA and the packages exist; elsewhere stop before any step, in one line.

Each Step of the plan is executed as printed: a command runs with subprocess, a Python call is made with
the plan's arguments. Requirements are checked first, all of them, so a machine without a GPU learns
everything it lacks at once and nothing is half-built.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Optional

from specpipe.builder.config import BuildConfig
from specpipe.builder.plan import PLAN_JSON, Plan, plan_jobs, tensorrt_engine_dir, write_plan_repository, write_serve_config
from specpipe.builder.steps import Step
from specpipe.engines import upstream
from specpipe.errors import EngineError, SpecpipeError

Progress = Callable[[str], None]


class GpuUnavailableError(SpecpipeError):
    """The machine lacks what a real GPU build needs (CUDA, packages, the pinned checkout)."""


def missing_requirements(plan: Plan, cfg: BuildConfig) -> list[str]:
    """What this machine lacks for `plan`, each as a short phrase; empty when the build can run."""
    needs = set(plan.requirements())
    missing = []
    if "cuda" in needs and not _cuda_available():
        missing.append("a CUDA GPU (torch.cuda.is_available() is False)")
    if "tensorrt" in needs and importlib.util.find_spec("tensorrt") is None:
        missing.append(f"the tensorrt package (>= {upstream.TENSORRT_MIN_VERSION})")
    if "tensorrt_llm" in needs:
        found = _version("tensorrt-llm")
        if plan.flow == "engine":
            wanted = f"tensorrt-llm=={upstream.TRTLLM_ENGINE_VERSION}"
            if found is None:
                missing.append(wanted)
            elif found != upstream.TRTLLM_ENGINE_VERSION:
                missing.append(f"{wanted} (found {found}; the TensorRT engine path was removed after {upstream.TRTLLM_LAST_ENGINE_RC})")
        else:
            wanted = f"tensorrt-llm>={upstream.TRTLLM_LLMAPI_MIN_VERSION}"
            if found is None:
                missing.append(wanted)
            elif not _at_least(found, upstream.TRTLLM_LLMAPI_MIN_VERSION):
                missing.append(f"{wanted} (found {found}; or use --trtllm-flow engine with {upstream.TRTLLM_ENGINE_VERSION})")
    if "trtllm-build" in needs and shutil.which(upstream.TRTLLM_BUILD) is None:
        missing.append("trtllm-build on PATH")
    if "modelopt" in needs and importlib.util.find_spec("modelopt") is None:
        missing.append("nvidia-modelopt")
    if "modelopt-checkout" in needs:
        script = Path(cfg.backend.modelopt_checkout) / upstream.MODELOPT_PTQ_SCRIPT
        if not script.is_file():
            missing.append(f"a NVIDIA/Model-Optimizer checkout in {cfg.backend.modelopt_checkout} (--modelopt-checkout; no {script})")
    if "trtllm-checkout" in needs:
        checkout = Path(cfg.backend.trtllm_checkout)
        probe = checkout / (upstream.QUANTIZE_SCRIPT if plan.flow == "engine" else upstream.LLMAPI_TEMPLATES_DIR)
        if not probe.exists():
            tag = upstream.TRTLLM_ENGINE_TAG if plan.flow == "engine" else f"a >= v{upstream.TRTLLM_LLMAPI_MIN_VERSION} tag"
            missing.append(f"a NVIDIA/TensorRT-LLM checkout at {tag} in {checkout} (--trtllm-checkout; no {probe})")
    return missing


def run_plan(plan: Plan, cfg: BuildConfig, progress: Optional[Progress] = None) -> Path:
    """Build everything the plan lists. Returns the work folder (engines/<name>)."""
    say = progress or (lambda msg: None)
    missing = missing_requirements(plan, cfg)
    if missing:
        raise GpuUnavailableError(
            f"cannot run the {plan.backend} build here, it needs: {'; '.join(missing)} (nothing was built; --dry-run prints the plan)"
        )
    work = Path(plan.work_dir)
    for step in plan.steps:
        say(f"{step.id}: {step.title}")
        _RUN[step.kind](step, plan, cfg, work)
    return work


def _command(step: Step, plan: Plan, cfg: BuildConfig, work: Path) -> None:
    result = subprocess.run(step.argv, capture_output=True, text=True)
    if result.returncode != 0:
        tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        raise EngineError(f"{step.id} failed (exit {result.returncode}): {tail}")


def _resolve(step, plan, cfg, work):
    from specpipe.checkpoint import check_pair, resolve_checkpoint
    from specpipe.checkpoint.eagle3 import read_eagle3_head

    resolved = resolve_checkpoint(step.kwargs["spec"], allow_pickle=cfg.allow_pickle)
    link = work / "hf" / step.role
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(Path(resolved.path).absolute(), target_is_directory=True)
    if step.role == "draft" and read_eagle3_head(str(link)) is None:  # a head has no tokenizer to compare
        check_pair(work / "hf" / "target", link)


def _tokenizer(step, plan, cfg, work):
    from specpipe.checkpoint import load_tokenizer

    load_tokenizer(Path(step.kwargs["path"])).save_pretrained(str(work / "tokenizer"))


def _export(step, plan, cfg, work):
    from specpipe.export.onnx import export_onnx

    export_onnx(Path(step.kwargs["checkpoint"]), Path(step.kwargs["out_dir"]))


def _quantize(step, plan, cfg, work):
    from transformers import AutoTokenizer

    from specpipe.quantize.calibration import calibration_batches
    from specpipe.quantize.graph import load_model, untie_lm_head
    from specpipe.quantize.static import quantize_calibrated

    quant = cfg.quant if step.role == "target" else cfg.draft_quant  # its calibration prompts, size and window
    tokenizer = AutoTokenizer.from_pretrained(str(work / "tokenizer"))
    model = load_model(Path(step.kwargs["model"]).parent)
    untie_lm_head(model)
    quantize_calibrated(
        model, Path(step.kwargs["out_dir"]), mode=quant.mode, calib=calibration_batches(tokenizer, quant),
        window=quant.calib_window, smooth_quant=False, symmetric_activations=bool(step.kwargs.get("symmetric_activations")),
    )  # fmt: skip


def _autocast(step, plan, cfg, work):
    from specpipe.engines.tensorrt_build import autocast

    dtype = next(k for k, v in upstream.AUTOCAST_LOW_PRECISION.items() if v == step.kwargs["low_precision_type"])
    autocast(Path(step.kwargs["onnx_path"]), Path(step.writes[0]).parent, dtype)


def _tensorrt_engine(step, plan, cfg, work):
    from specpipe.engines.tensorrt_build import build_engine, optimization_profiles, write_tensorrt_meta

    model = plan.model(step.role)
    limits = plan.limits
    profiles = optimization_profiles(
        model.shape, max_seq_len=limits.max_seq_len, max_input_len=limits.max_input_len, max_draft_len=limits.max_draft_len
    )
    out = tensorrt_engine_dir(work, step.role)
    build_engine(Path(step.kwargs["onnx"]), out, profiles)
    precision = limits.dtype if model.quant == "none" else "float32"
    write_tensorrt_meta(
        out, model.shape, profiles, max_seq_len=limits.max_seq_len, max_draft_len=limits.max_draft_len,
        precision=precision, quant=model.quant,
    )  # fmt: skip


def _manifest(step, plan, cfg, work):
    """The TensorRT deployment's manifest, as the CPU build writes one: what `specpipe serve`, `validate`,
    `generate` and `bench` open. Step costs are timed on these engines, on this GPU."""
    import json

    from specpipe.checkpoint import inspect_checkpoint, load_tokenizer, tokenizer_hash, weights_sha256
    from specpipe.engines import load_engine
    from specpipe.contract.manifest import (
        EngineRecord,
        Manifest,
        ModelEntry,
        TokenizerRecord,
        file_hashes,
        write_manifest,
    )
    from specpipe.drafts.model import ModelDraft
    from specpipe.builder.measure import measure_step_costs

    if plan.backend == "trtllm":  # served by TensorRT-LLM: nothing to time here, the artifacts hashed
        from specpipe.builder.trtllm_manifest import built_manifest

        write_manifest(work, built_manifest(plan, cfg))
        return
    entries = {}
    for model in (plan.target, plan.draft):
        folder, checkpoint = tensorrt_engine_dir(work, model.role), work / "hf" / model.role
        entries[model.role] = ModelEntry(
            source=model.spec, resolved_path=str(checkpoint.resolve()), weights_sha256=weights_sha256(checkpoint),
            checkpoint=inspect_checkpoint(checkpoint).model_dump(mode="json"),
            engine=EngineRecord(path=folder.name, backend="tensorrt", quant=model.quant, files=file_hashes(folder)),
        )  # fmt: skip
    engines = {role: load_engine(work / entry.engine.path) for role, entry in entries.items()}
    write_manifest(work, Manifest.new(
        name=plan.name, build=json.loads(cfg.model_dump_json()),
        tokenizer=TokenizerRecord(path="tokenizer", hash=tokenizer_hash(load_tokenizer(work / "tokenizer"))),
        eos_token_ids=sorted(inspect_checkpoint(work / "hf" / "target").eos_token_ids), max_draft_len=plan.limits.max_draft_len,
        step_costs=measure_step_costs(engines["target"], engines["draft"]),
        target=entries["target"], draft=ModelDraft.of(entries["draft"]),
    ))  # fmt: skip


def _repository(step, plan, cfg, work):
    if plan.backend == "tensorrt":  # specpipe's own repository, over the deployment just built
        from specpipe.triton.repository import DEFAULT_MODEL_NAME, write_repository

        write_repository(work, Path(plan.repo_dir), instance_count=cfg.triton_instances,
                         stream_interval=cfg.stream_interval, model_name=DEFAULT_MODEL_NAME, force=True)
    else:
        write_plan_repository(plan, cfg)


def _repository_check(step, plan, cfg, work):
    """The written config.pbtxt files against the pinned checkout's templates, tensor by tensor."""
    from specpipe.triton.model_config import read_config

    repo = Path(plan.repo_dir)
    names = [p.name for p in sorted(repo.iterdir()) if (p / "config.pbtxt").is_file()]
    problems = []
    for name in names:
        ours = read_config(repo / name)
        problems += _compare_proto(name, ours, Path(step.kwargs["templates_dir"]), plan.flow)
    if problems:
        raise EngineError("the repository does not match the pinned tensorrtllm_backend templates: " + "; ".join(problems))


def _compare_proto(name: str, ours, templates: Path, flow: str) -> list[str]:
    from specpipe.triton.trtllm_repo import parse_template

    template = templates / ("" if flow == "llmapi" else ("tensorrt_llm" if name == "tensorrt_llm_draft" else name)) / "config.pbtxt"
    theirs = parse_template(template.read_text())
    problems = []
    for kind in ("input", "output"):
        a = {t.name for t in getattr(ours, kind)}
        b = {t.name for t in getattr(theirs, kind)}
        problems += [f"{name}: {kind} {n!r} differs" for n in sorted(a ^ b)]
    return problems


def _model_py(step, plan, cfg, work):
    from specpipe.triton.trtllm_repo import copy_upstream_model_files

    repo = Path(plan.repo_dir)
    names = [p.name for p in sorted(repo.iterdir()) if p.is_dir()]
    copy_upstream_model_files(repo, Path(step.kwargs["checkout"]), plan.flow, names)


def _serve_config(step, plan, cfg, work):
    write_serve_config(plan, cfg)


def _llm_args(step, plan, cfg, work):
    """The installed TensorRT-LLM's own validation of the LLM arguments (unknown or bad fields fail here, not at serve time)."""
    import yaml
    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    from specpipe.builder.trtllm import llmapi_model_dir

    target = plan_jobs(plan)[0]
    try:
        TorchLlmArgs(model=str(llmapi_model_dir(target).absolute()), **yaml.safe_load(Path(step.kwargs["config"]).read_text()))
    except Exception as err:
        raise EngineError(f"TensorRT-LLM refuses {step.kwargs['config']}: {type(err).__name__}: {' '.join(str(err).split())}") from None


def _plan_json(step, plan, cfg, work):
    work.mkdir(parents=True, exist_ok=True)
    (work / PLAN_JSON).write_text(plan.model_dump_json(indent=2) + "\n")


_RUN: dict[str, Callable[[Step, Plan, BuildConfig, Path], None]] = {
    "command": _command,
    "resolve": _resolve,
    "tokenizer": _tokenizer,
    "export": _export,
    "quantize": _quantize,
    "autocast": _autocast,
    "tensorrt_engine": _tensorrt_engine,
    "manifest": _manifest,
    "repository": _repository,
    "repository_check": _repository_check,
    "model_py": _model_py,
    "serve_config": _serve_config,
    "llm_args": _llm_args,
    "plan": _plan_json,
}


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _at_least(found: str, wanted: str) -> bool:
    from packaging.version import Version

    return Version(found) >= Version(wanted)


def _version(dist: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None
