"""`make_plan(cfg) -> Plan`: every step of a GPU build, every file it writes, and the memory it needs per GPU,
decided before anything runs. `render_plan(plan)` prints it for a person; `plan.model_dump_json()` for
scripts. The runner (specpipe/builder/run.py) executes the same steps where CUDA and the packages exist.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict

from specpipe.builder.memory import MemoryPlan, model_memory, place, valid_tp
from specpipe.builder.steps import Step
from specpipe.builder.trtllm import (
    Limits,
    ModelJob,
    check_draft_len_schedule,
    default_draft_len_schedule,
    engine_flow_steps,
    engine_kv_cache_dtype,
    is_eagle3_head,
    llmapi_model_yaml,
    llmapi_quantize_step,
    serve_command,
    trtllm_serve_command,
    trtllm_serve_config,
)
from specpipe.builder.config import BuildConfig, TrtllmBackend
from specpipe.checkpoint.eagle3 import read_eagle3_head
from specpipe.drafts import kind_of
from specpipe.checkpoint.facts import ModelShape, resolve_shape
from specpipe.config import MAX_SEQ_LEN
from specpipe.contract.decoding import schedule_text
from specpipe.contract.manifest import MANIFEST, Manifest
from specpipe.engines import upstream
from specpipe.engines.tensorrt_build import PLAN_FILE, optimization_profiles
from specpipe.errors import UsageError
from specpipe.triton.repository import DEFAULT_MODEL_NAME

SHARED_KV_FRACTION = 0.45  # each of two models on one GPU: whichever loads first leaves room for the other
ALONE_KV_FRACTION = 0.9  # tensorrtllm_backend's default (docs/model_config.md)
TP_CANDIDATES = (1, 2, 4, 8)  # one 8-GPU node: tensor parallelism wants NVLink between its ranks
PLAN_JSON = "gpu_plan.json"
SERVE_CONFIG = "trtllm-serve.yaml"  # llmapi flow: trtllm-serve's --extra_llm_api_options file, in the work folder


class GpuMemoryError(UsageError):
    """The plan does not fit the GPUs given; says what would."""

    def __init__(self, message: str, *, peak_gb: float, gpu_memory_gb: float, suggested_tp: Optional[int]):
        self.peak_gb, self.gpu_memory_gb, self.suggested_tp = peak_gb, gpu_memory_gb, suggested_tp
        super().__init__(message)


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PlannedModel(_Frozen):
    role: str
    spec: str  # what the user named: an alias or a folder
    shape: ModelShape
    quant: str
    kv_cache_dtype: str
    tp: int
    gpus: tuple[int, ...]
    artifacts: str  # folder of its engine(s)


class Plan(_Frozen):
    backend: str
    flow: str  # engine | llmapi (trtllm), onnx (tensorrt)
    name: str
    work_dir: str
    repo_dir: Optional[str]
    versions: dict[str, str]
    limits: Limits
    target: PlannedModel
    draft: Optional[PlannedModel]  # None: n-gram drafting (--draft ngram), no draft model
    steps: tuple[Step, ...]
    repository: tuple[str, ...]  # files under repo_dir
    memory: MemoryPlan
    serve: tuple[str, ...]
    notes: tuple[str, ...]
    # TensorRT-LLM: the manifest the build writes last, as far as a dry run knows it (builder/trtllm_manifest.py)
    manifest: Optional[Manifest] = None

    @property
    def files(self) -> list[str]:
        """Everything the build writes: step outputs, then the Triton repository."""
        written = [path for step in self.steps for path in step.writes]
        return written + [p for p in self.repository if p not in written]

    def model(self, role: str) -> PlannedModel:
        return self.target if role == "target" else self.draft

    @property
    def gpu_steps(self) -> list[Step]:
        return [s for s in self.steps if s.gpu]

    def requirements(self) -> list[str]:
        return sorted({need for step in self.steps for need in step.needs})


def _prompt_lookup(cfg: BuildConfig) -> bool:
    return kind_of(cfg.draft[0]).name == "ngram"


def make_plan(cfg: BuildConfig) -> Plan:
    """Check the request against the models, the upstream tools and the GPU memory, then lay out the steps."""
    kind = kind_of(cfg.draft[0]).name  # the draft kinds' registry names --draft (a speculators-format head: refused)
    ngram = kind == "ngram"
    target = resolve_shape(cfg.target)
    head = read_eagle3_head(cfg.draft[0]) if kind == "eagle3" else None
    draft = None if ngram else resolve_shape(cfg.draft[0])
    # an EAGLE-3 head has no tokenizer of its own: it reads the target's hidden states, not its tokens
    notes = _check_pair(cfg.target, cfg.draft[0]) if draft is not None and head is None else []
    if _flow(cfg) == "llmapi" and cfg.backend.draft_tp_size != cfg.backend.tp_size and not ngram:
        # the LLM API loads the draft into the target's executor, split over the same GPUs
        notes.append(f"the draft runs inside the target's LLM on its {cfg.backend.tp_size} GPU(s) (tp {cfg.backend.tp_size}), not --draft-tp-size {cfg.backend.draft_tp_size}")
        cfg = _with_backend(cfg, draft_tp_size=cfg.backend.tp_size)
    _check_options(cfg, target, draft)
    max_seq_len = cfg.backend.max_seq_len or min(target.context_length, MAX_SEQ_LEN)
    if cfg.backend.max_input_len >= max_seq_len:
        raise UsageError(f"--max-input-len {cfg.backend.max_input_len} must be below the sequence length {max_seq_len}")
    contexts = [target.context_length] + ([draft.context_length] if draft is not None else [])
    if max_seq_len > min(contexts):
        notes.append(f"max_seq_len {max_seq_len} is beyond a model's trained context ({' / '.join(map(str, contexts))})")
    limits = Limits(
        dtype=cfg.backend.dtype, max_batch_size=cfg.backend.max_batch_size, max_input_len=cfg.backend.max_input_len,
        max_seq_len=max_seq_len, max_draft_len=cfg.max_draft_len,
        calib_size=cfg.backend.calib_size if isinstance(cfg.backend, TrtllmBackend) else None,
    )  # fmt: skip

    name = cfg.output_name
    work = Path(cfg.engines_dir) / name
    shared = cfg.backend.draft_placement == "shared"
    target_gpus = tuple(range(cfg.backend.tp_size))
    first_draft = 0 if shared else cfg.backend.tp_size
    draft_gpus = tuple(range(first_draft, first_draft + cfg.backend.draft_tp_size))
    target_kv, draft_kv = _kv_cache_dtypes(cfg, notes)
    jobs = [ModelJob("target", cfg.target, target, work / "hf" / "target", cfg.quant.mode, target_kv, cfg.backend.tp_size, target_gpus, work / "trtllm" / "target")]
    if draft is not None:
        jobs.append(
            ModelJob("draft", cfg.draft[0], draft, work / "hf" / "draft", cfg.draft_quant.mode, draft_kv, cfg.backend.draft_tp_size, draft_gpus, work / "trtllm" / "draft")
        )  # fmt: skip
    memory = plan_memory(cfg, target, draft, max_seq_len, kv_cache_dtypes=(target_kv, draft_kv))
    _check_fits(cfg, target, draft, max_seq_len, memory, notes)

    repo = Path(cfg.repo_dir) if cfg.repo_dir is not None else None
    steps = _resolve_steps(cfg, work)
    if cfg.backend.kind == "tensorrt":
        flow = "onnx"
        steps += _tensorrt_steps(cfg, jobs, limits, work, repo)
        repository: list[Path] = []
        serve: tuple[str, ...] = ("specpipe", "serve", str(repo)) if repo else ()
        notes.append("the Triton repository is specpipe's own (Python backend over specpipe.speculative): engine.json names the tensorrt backend")
    else:
        flow = _flow(cfg)
        kv_fraction = _kv_fraction(cfg)
        if flow == "engine":
            steps += engine_flow_steps(jobs, limits, Path(cfg.backend.trtllm_checkout))
        else:
            steps += [s for s in (llmapi_quantize_step(job, limits, Path(cfg.backend.modelopt_checkout)) for job in jobs) if s]
            steps.append(
                Step(
                    id="serve_config", title="write trtllm-serve's LLM-API YAML (speculative_config, in-flight batching)",
                    kind="serve_config", writes=(str(work / SERVE_CONFIG),), source="specpipe/builder/trtllm.py LlmApiArgs",
                )  # fmt: skip
            )
            steps.append(
                Step(
                    id="llm_args", title="validate that YAML with the installed TensorRT-LLM's own TorchLlmArgs",
                    kind="llm_args", call="tensorrt_llm.llmapi.llm_args.TorchLlmArgs", kwargs={"config": str(work / SERVE_CONFIG)},
                    needs=("tensorrt_llm",), source="tensorrt_llm/llmapi/llm_args.py",
                )  # fmt: skip
            )
        repository = []
        if repo is not None:
            steps_repo, repository = _repository_steps(cfg, jobs, limits, work, repo, kv_fraction)
            steps += steps_repo
        serve = serve_command(repo, Path(cfg.backend.trtllm_checkout), flow) if repo else ()
        if flow == "engine":
            notes.append(
                "speculative requests go to tensorrt_llm_bls with num_draft_tokens > 0 and stream false (upstream's BLS"
                " refuses streaming with speculation); `ensemble` serves the target alone"
            )
            notes.append(
                f"in-flight batching: up to {cfg.backend.max_batch_size} requests per engine; TensorRT-LLM {upstream.TRTLLM_ENGINE_VERSION}'s"
                " draft-target path has no batch-size schedule: clients choose num_draft_tokens per request"
            )
        else:
            schedule = draft_len_schedule(cfg)
            if draft is None:
                notes.append("n-gram drafting (NGramDecodingConfig): drafts are looked up in the request's own tokens, no draft model")
            elif head is not None or is_eagle3_head(draft):
                captured = head.layers_to_capture if head is not None else None
                notes.append(
                    "the draft is an EAGLE-3 head: speculative_config is Eagle3, "
                    + (f"eagle3_layers_to_capture {list(captured)}" if captured else "TensorRT-LLM's default captured layers")
                )
            notes.append(
                f"in-flight batching: up to {cfg.backend.max_batch_size} requests; draft length by batch size {schedule}"
                f" (TensorRT-LLM {upstream.TRTLLM_LLMAPI_VERSION}: draft_len_schedule for Eagle3, max_concurrency otherwise)"
            )
            notes.append("without Triton: " + " ".join(trtllm_serve_command(_llmapi_target_dir(jobs[0]), work / SERVE_CONFIG)))
        steps.append(
            Step(
                id="manifest", title="write the manifest (the CPU build's typed Manifest; hashes of what was built)",
                kind="manifest", writes=(str(work / MANIFEST),), source="specpipe/builder/trtllm_manifest.py",
            )  # fmt: skip
        )
    steps.append(
        Step(id="plan", title="record the plan", kind="plan", writes=(str(work / PLAN_JSON),), source="specpipe")
    )
    versions = {"tensorrt_llm": upstream.TRTLLM_ENGINE_VERSION if cfg.backend.kind == "trtllm" else "-", "tensorrt": f">={upstream.TENSORRT_MIN_VERSION}"}
    if _flow(cfg) == "llmapi":
        versions = {"tensorrt_llm": f"{upstream.TRTLLM_LLMAPI_VERSION} ({upstream.TRTLLM_LLMAPI_TAG} @{upstream.TRTLLM_LLMAPI_COMMIT}; LLM API, PyTorch backend; no engine build)"}
    plan = Plan(
        backend=cfg.backend.kind, flow=flow, name=name, work_dir=str(work), repo_dir=str(repo) if repo else None,
        versions=versions,
        limits=limits,
        target=_planned(jobs[0], cfg, work), draft=_planned(jobs[1], cfg, work) if len(jobs) > 1 else None,
        steps=tuple(steps), repository=tuple(str(p) for p in repository), memory=memory, serve=serve, notes=tuple(notes),
    )  # fmt: skip
    return plan  # a TensorRT-LLM plan gets its manifest in specpipe.builder.make_plan (builder/trtllm_manifest.py)


def plan_memory(
    cfg: BuildConfig, target: ModelShape, draft: Optional[ModelShape], max_seq_len: int, *, tp_size: Optional[int] = None,
    kv_cache_dtypes: Optional[tuple[str, str]] = None,
) -> MemoryPlan:
    tp = tp_size or cfg.backend.tp_size
    kv_dtypes = dict(zip(("target", "draft"), kv_cache_dtypes or _kv_cache_dtypes(cfg, [])))
    kv_tokens = cfg.backend.max_batch_size * max_seq_len
    onnx_qdq = cfg.backend.kind == "tensorrt"  # a Q/DQ graph keeps its other ops (and KV) in fp32

    def one(role: str, shape: ModelShape, quant: str, model_tp: int):
        dtype_bytes = 4 if onnx_qdq and quant != "none" else 2
        return model_memory(
            role, shape, quant=quant, kv_cache_dtype=kv_dtypes[role], tp=model_tp, kv_tokens=kv_tokens,
            separate_lm_head=cfg.backend.kind == "trtllm", dtype_bytes=dtype_bytes,
        )  # fmt: skip

    return place(
        one("target", target, cfg.quant.mode, tp),
        one("draft", draft, cfg.draft_quant.mode, tp if _draft_follows_target(cfg) else cfg.backend.draft_tp_size) if draft is not None else None,
        shared=cfg.backend.draft_placement == "shared", gpu_memory_gb=cfg.backend.gpu_memory_gb,
    )  # fmt: skip


def _draft_follows_target(cfg: BuildConfig) -> bool:
    """The LLM API runs the draft inside the target's executor, with the target's tensor parallel split."""
    return _flow(cfg) == "llmapi"


def suggest_tp(cfg: BuildConfig, target: ModelShape, draft: Optional[ModelShape], max_seq_len: int) -> Optional[tuple[int, float]]:
    """The smallest valid target tp size whose busiest GPU fits cfg.backend.gpu_memory_gb: (tp, peak GB)."""
    for tp in TP_CANDIDATES:
        if valid_tp(target, tp) is None:
            memory = plan_memory(cfg, target, draft, max_seq_len, tp_size=tp)
            if memory.fits:
                return tp, memory.peak_gb
    return None


def _check_fits(cfg: BuildConfig, target: ModelShape, draft: Optional[ModelShape], max_seq_len: int, memory: MemoryPlan, notes: list) -> None:
    if cfg.backend.gpu_memory_gb is None:
        notes.append("no --gpu-memory-gb given: the memory table is not checked against a GPU")
        return
    best = suggest_tp(cfg, target, draft, max_seq_len) if cfg.backend.kind == "trtllm" else None
    if memory.fits:
        if best and best[0] < cfg.backend.tp_size:
            notes.append(f"--tp-size {best[0]} would also fit {cfg.backend.gpu_memory_gb:g} GB GPUs (busiest GPU {best[1]:.1f} GB)")
        return
    busiest = max(memory.gpus, key=lambda g: g.total_gb)
    head = (
        f"{cfg.target} ({cfg.quant.mode}) + {cfg.draft[0]} ({cfg.draft_quant.mode}) at --tp-size {cfg.backend.tp_size} needs {memory.peak_gb:.1f} GB"
        f" on GPU {busiest.gpu} (weights {busiest.weights_gb:.1f}, KV cache {busiest.kv_cache_gb:.1f}, reserve"
        f" {busiest.reserve_gb:.1f}; {', '.join(busiest.models)}) but --gpu-memory-gb is {cfg.backend.gpu_memory_gb:g}"
    )
    if best is not None:
        raise GpuMemoryError(
            f"{head}: use --tp-size {best[0]} (busiest GPU {best[1]:.1f} GB)",
            peak_gb=memory.peak_gb, gpu_memory_gb=cfg.backend.gpu_memory_gb, suggested_tp=best[0],
        )  # fmt: skip
    if cfg.backend.kind == "trtllm" and cfg.backend.draft_placement == "shared" and draft is not None and not _draft_follows_target(cfg):
        alone = suggest_tp(_with_backend(cfg, draft_placement="separate"), target, draft, max_seq_len)
        if alone is not None:
            raise GpuMemoryError(
                f"{head}: give the draft its own GPU: --draft-placement separate --tp-size {alone[0]} (busiest GPU {alone[1]:.1f} GB)",
                peak_gb=memory.peak_gb, gpu_memory_gb=cfg.backend.gpu_memory_gb, suggested_tp=alone[0],
            )  # fmt: skip
    limit = TP_CANDIDATES[-1] if cfg.backend.kind == "trtllm" else 1
    raise GpuMemoryError(
        f"{head}, and no --tp-size up to {limit} fits: lower --max-batch-size or --max-seq-len, use --kv-cache-dtype fp8,"
        " or quantize (--quant / --draft-quant)",
        peak_gb=memory.peak_gb, gpu_memory_gb=cfg.backend.gpu_memory_gb, suggested_tp=None,
    )  # fmt: skip


def _check_pair(target: str, draft: str) -> list[str]:
    """Offline pair check: aliases carry tokenizer families; folders are checked token by token at build time."""
    from specpipe.checkpoint import check_facts_pair, get_alias

    t, d = get_alias(target), get_alias(draft)
    if t is not None and d is not None:
        check_facts_pair(t, d)  # raises IncompatiblePairError listing every problem
        return []
    return ["the draft/target tokenizers are compared token by token when the build resolves the checkpoints"]


def _check_options(cfg: BuildConfig, target: ModelShape, draft: Optional[ModelShape]) -> None:
    problems = []
    if draft is None and _flow(cfg) != "llmapi":
        raise UsageError("--draft ngram on a GPU needs --backend trtllm and the LLM-API flow (NGramDecodingConfig)")
    if cfg.backend.kind == "trtllm" and cfg.stream_interval != 1:
        # TensorRT-LLM's own Triton models stream as its executor does; specpipe's Python model is not among them
        problems.append(f"--stream-interval {cfg.stream_interval} applies to specpipe's Triton model (--backend onnxruntime"
                        " or tensorrt), not to TensorRT-LLM's repository")
    if cfg.backend.kind == "tensorrt":
        for flag, mode in (("--quant", cfg.quant.mode), ("--draft-quant", cfg.draft_quant.mode)):
            if mode in ("int8-wo", "int4-wo"):
                problems.append(
                    f"{flag} {mode} writes ONNX Runtime's MatMulNBits, which TensorRT cannot parse; use fp8 or int8 (Q/DQ),"
                    " or --backend trtllm"
                )
        if cfg.quant.kv_cache_dtype != "auto":
            problems.append("the tensorrt backend keeps the KV cache in the graph's dtype; --kv-cache-dtype needs --backend trtllm")
    elif _flow(cfg) == "llmapi":
        if cfg.backend.draft_placement == "separate":
            problems.append("--draft-placement separate needs --trtllm-flow engine: the LLM API runs the draft inside the target's LLM")
        # TensorRT-LLM's PyTorch backend runs FP8, NVFP4 and W4A16/W4A8 weights and an FP8/NVFP4 KV cache; no INT8
        for flag, mode in (("--quant", cfg.quant.mode), ("--draft-quant", cfg.draft_quant.mode)):
            if mode not in upstream.LLMAPI_QUANT_MODES:
                problems.append(
                    f"{flag} {mode} is not supported by TensorRT-LLM's PyTorch backend (LLM-API flow): use"
                    f" {' or '.join(m for m in upstream.LLMAPI_QUANT_MODES if m != 'none')}, or --trtllm-flow engine"
                )
        if cfg.quant.kv_cache_dtype not in upstream.LLMAPI_KV_CACHE_DTYPES:
            problems.append(f"--kv-cache-dtype {cfg.quant.kv_cache_dtype} is not supported by TensorRT-LLM's PyTorch backend: use fp8")
        problems += check_draft_len_schedule(draft_len_schedule(cfg), cfg.max_draft_len)
    else:
        if cfg.quant.kv_cache_dtype == "int8":
            problems.append(
                "--kv-cache-dtype int8 cannot be used with paged context FMHA, which draft-target decoding needs"
                " (NVIDIA/TensorRT-LLM issue 2166); use fp8"
            )
        if cfg.quant.kv_cache_dtype == "fp8" and cfg.quant.mode not in upstream.FP8_KV_WEIGHT_QUANT:
            problems.append(
                f"--kv-cache-dtype fp8 with --quant {cfg.quant.mode} would make TensorRT-LLM {upstream.TRTLLM_ENGINE_VERSION}'s builder"
                " turn paged context FMHA off (it keeps an fp8 KV cache only with fp8 weights): use --quant fp8, or the LLM-API flow"
            )
    if cfg.backend.kind == "trtllm":
        if _flow(cfg) == "engine" and draft is not None and is_eagle3_head(draft):
            problems.append("an EAGLE-3 head drafts through the LLM-API flow only; drop --trtllm-flow engine")
        models = (("target", cfg.target, target, cfg.backend.tp_size),)
        models += (("draft", cfg.draft[0], draft, cfg.backend.draft_tp_size),) if draft is not None else ()
        for role, spec, shape, tp in models:
            why = valid_tp(shape, tp)
            if why:
                problems.append(f"{role} {spec}: {why}")
    if problems:
        raise UsageError("; ".join(problems))


def draft_len_schedule(cfg: BuildConfig) -> dict[int, int]:
    return dict(sorted((cfg.backend.draft_len_schedule or default_draft_len_schedule(cfg.max_draft_len, cfg.backend.max_batch_size)).items()))


def _kv_cache_dtypes(cfg: BuildConfig, notes: list) -> tuple[str, str]:
    """(target, draft) KV cache dtypes. The engine flow keeps an fp8 KV cache only where the weights are fp8
    (engine_kv_cache_dtype); the target's case was refused in _check_options, the draft's is said here."""
    if _flow(cfg) != "engine":
        return cfg.quant.kv_cache_dtype, cfg.quant.kv_cache_dtype
    target_kv = engine_kv_cache_dtype(cfg.quant.mode, cfg.quant.kv_cache_dtype)
    draft_kv = engine_kv_cache_dtype(cfg.draft_quant.mode, cfg.quant.kv_cache_dtype)
    if draft_kv != cfg.quant.kv_cache_dtype:
        notes.append(
            f"the draft keeps a {cfg.backend.dtype} KV cache: an fp8 KV cache without fp8 weights (--draft-quant {cfg.draft_quant.mode})"
            " would turn its paged context FMHA off"
        )
    return target_kv, draft_kv


def _llmapi_target_dir(job: ModelJob) -> Path:
    from specpipe.builder.trtllm import llmapi_model_dir

    return llmapi_model_dir(job)


def _resolve_steps(cfg: BuildConfig, work: Path) -> list[Step]:
    from specpipe.checkpoint import get_alias

    steps = []
    for role, spec in (("target", cfg.target), ("draft", cfg.draft[0]))[: 1 if _prompt_lookup(cfg) else 2]:
        facts = get_alias(spec)
        steps.append(
            Step(
                id=f"{role}.resolve", title=f"resolve the {role} {spec} to a local Hugging Face folder",
                kind="resolve", role=role, call="specpipe.checkpoint.resolve_checkpoint", kwargs={"spec": spec},
                writes=(str(work / "hf" / role),), needs=("hub",) if facts is not None and facts.source == "hub" else (),
                source="specpipe/checkpoint/resolve.py",
            )  # fmt: skip
        )
    steps.append(
        Step(
            id="tokenizer", title="save the target's tokenizer (pre/postprocessing load it)", kind="tokenizer",
            call="specpipe.checkpoint.load_tokenizer", kwargs={"path": str(work / "hf" / "target")},
            writes=(str(work / "tokenizer"),), source="specpipe/checkpoint/load.py",
        )  # fmt: skip
    )
    return steps


def tensorrt_engine_dir(work: Path, role: str) -> Path:
    """A TensorRT engine's folder: where the CPU build keeps its engine of the same role."""
    return work / role


def _tensorrt_steps(cfg: BuildConfig, jobs: list[ModelJob], limits: Limits, work: Path, repo: Optional[Path]) -> list[Step]:
    """Each model exported once from its resolved folder, made low precision (Q/DQ or AutoCast), built into an
    engine; then the manifest that deployment, gate and bench open, and specpipe's Triton repository."""
    steps = []
    for job in jobs:
        raw = work / "onnx" / job.role
        steps.append(
            Step(
                id=f"{job.role}.export", title=f"export the {job.role} to ONNX (text-generation-with-past)", kind="export",
                role=job.role, call="specpipe.export.onnx.export_onnx", kwargs={"checkpoint": str(job.hf_dir), "out_dir": str(raw)},
                writes=(str(raw / "model.onnx"),), source="optimum-onnx main_export",
            )  # fmt: skip
        )
        graph = raw / "model.onnx"
        if job.quant != "none":
            qdq = work / "onnx" / f"{job.role}-{job.quant}"
            steps.append(
                Step(
                    id=f"{job.role}.quantize", title=f"{job.quant} Q/DQ graph with calibrated scales", kind="quantize",
                    role=job.role, call="specpipe.quantize.static.quantize_calibrated",
                    # TensorRT's quantize layer takes symmetric (zero-point 0) activations only (defect 7)
                    kwargs={"model": str(graph), "out_dir": str(qdq), "mode": job.quant, "symmetric_activations": True},
                    writes=(str(qdq / "model.onnx"),),
                    source="specpipe/quantize/static.py",
                )  # fmt: skip
            )
            graph = qdq / "model.onnx"
        else:
            mixed = work / "onnx" / f"{job.role}-{cfg.backend.dtype}"
            steps.append(
                Step(
                    id=f"{job.role}.autocast", title=f"{cfg.backend.dtype} mixed precision with ModelOpt AutoCast", kind="autocast",
                    role=job.role, call="modelopt.onnx.autocast.convert_to_mixed_precision",
                    kwargs={"onnx_path": str(graph), "low_precision_type": upstream.AUTOCAST_LOW_PRECISION[cfg.backend.dtype], "keep_io_types": False},
                    writes=(str(mixed / "model.onnx"),), needs=("modelopt",),
                    source="TensorRT 11 migration guide (Python): ModelOpt AutoCast",
                )  # fmt: skip
            )
            graph = mixed / "model.onnx"
        profiles = optimization_profiles(
            job.shape, max_seq_len=limits.max_seq_len, max_input_len=limits.max_input_len, max_draft_len=limits.max_draft_len
        )
        engine_dir = tensorrt_engine_dir(work, job.role)
        steps.append(
            Step(
                id=f"{job.role}.engine", title=f"build the {job.role} TensorRT engine (strongly typed, 3 profiles)",
                kind="tensorrt_engine", role=job.role, call="tensorrt.Builder.build_serialized_network",
                kwargs={
                    "onnx": str(graph),
                    "network_flags": ["STRONGLY_TYPED"],
                    "profiles": {p.name: {"new_tokens": p.new_tokens.model_dump(), "past_tokens": p.past_tokens.model_dump()} for p in profiles},
                },
                writes=(str(engine_dir / PLAN_FILE), str(engine_dir / "engine.json")), needs=("cuda", "tensorrt"), gpu=True,
                source="NVIDIA/TensorRT python/src/infer/pyCore.cpp, python/src/parsers/pyOnnx.cpp",
            )  # fmt: skip
        )
    steps.append(
        Step(
            id="manifest", title="write the manifest of the TensorRT deployment (step costs timed on these engines)",
            kind="manifest", writes=(str(work / MANIFEST),), needs=("cuda", "tensorrt"), gpu=True, source="specpipe/contract/manifest.py",
        )  # fmt: skip
    )
    if repo is not None:
        steps.append(
            Step(
                id="repository", title="write specpipe's Triton repository (Python backend over specpipe.speculative)",
                kind="repository", writes=(str(repo / DEFAULT_MODEL_NAME),), source="specpipe/triton/repository.py",
            )  # fmt: skip
        )
    return steps


def _repository_steps(
    cfg: BuildConfig, jobs: list[ModelJob], limits: Limits, work: Path, repo: Path, kv_fraction: float
) -> tuple[list[Step], list[Path]]:
    from specpipe.triton import trtllm_repo

    models = repository_models(cfg, jobs, limits, work, kv_fraction)
    files = trtllm_repo.repository_files(models, repo, _flow(cfg))
    own = [f for f in files if f.name in ("config.pbtxt", "model.yaml")]
    copied = [f for f in files if f not in own]
    templates = Path(cfg.backend.trtllm_checkout) / (
        upstream.LLMAPI_TEMPLATES_DIR if _flow(cfg) == "llmapi" else upstream.TRITON_TEMPLATES_DIR
    )
    pinned = upstream.TRTLLM_ENGINE_TAG if _flow(cfg) == "engine" else f">= v{upstream.TRTLLM_LLMAPI_MIN_VERSION}"
    steps = [
        Step(
            id="repository", title=f"write the Triton repository ({', '.join(m.name for m in models)})", kind="repository",
            writes=tuple(str(f) for f in own), source="specpipe/triton/trtllm_repo.py (Triton model_config_pb2)",
        ),  # fmt: skip
        Step(
            id="repository.check", title="compare its tensors with the pinned checkout's templates", kind="repository_check",
            call="specpipe.triton.trtllm_repo.compare_with_templates", kwargs={"templates_dir": str(templates)},
            needs=("trtllm-checkout",), source=f"NVIDIA/TensorRT-LLM {pinned} {templates.relative_to(cfg.backend.trtllm_checkout)}",
        ),  # fmt: skip
        Step(
            id="repository.model_py", title="copy the Python models' code from the pinned checkout", kind="model_py",
            call="specpipe.triton.trtllm_repo.copy_upstream_model_files", kwargs={"checkout": str(cfg.backend.trtllm_checkout)},
            writes=tuple(str(f) for f in copied), needs=("trtllm-checkout",),
            source=f"NVIDIA/TensorRT-LLM {pinned} {templates.relative_to(cfg.backend.trtllm_checkout)}",
        ),  # fmt: skip
    ]
    return steps, files


def repository_models(cfg: BuildConfig, jobs: list[ModelJob], limits: Limits, work: Path, kv_fraction: float):
    from specpipe.triton import trtllm_repo

    if cfg.backend.kind != "trtllm":
        return []
    if _flow(cfg) == "llmapi":
        from specpipe.builder.trtllm import TritonSpec

        triton = TritonSpec()  # the same object writes model.yaml's triton_config
        return trtllm_repo.llmapi_models(max_batch_size=triton.max_batch_size, decoupled=triton.decoupled)
    target, draft = jobs
    settings = trtllm_repo.TrtllmRepoSettings(
        max_batch_size=limits.max_batch_size, tokenizer_dir=str((work / "tokenizer").absolute()),
        target_engine_dir=str(target.engine_dir.absolute()), draft_engine_dir=str(draft.engine_dir.absolute()),
        target_gpus=target.gpus, draft_gpus=draft.gpus, target_kv_fraction=kv_fraction, draft_kv_fraction=kv_fraction,
    )  # fmt: skip
    return trtllm_repo.trtllm_models(settings)


def write_plan_repository(plan: Plan, cfg: BuildConfig) -> list[Path]:
    """Write the repository's own files (config.pbtxt, model.yaml). Upstream model.py files are copied by
    the real build, from the pinned checkout."""
    from specpipe.triton import trtllm_repo

    if plan.repo_dir is None or cfg.backend.kind != "trtllm":
        return []
    jobs = plan_jobs(plan)
    limits = plan.limits
    kv_fraction = _kv_fraction(cfg)
    models = repository_models(cfg, jobs, limits, Path(plan.work_dir), kv_fraction)
    model_yaml = None
    written = []
    if _flow(cfg) == "llmapi":
        schedule = draft_len_schedule(cfg)
        model_yaml = llmapi_model_yaml(jobs[0], _draft_job(jobs), limits, kv_fraction, schedule, cfg.ngram).to_yaml()
        written.append(write_serve_config(plan, cfg))
    return trtllm_repo.write_repository(models, Path(plan.repo_dir), model_yaml=model_yaml) + written


def write_serve_config(plan: Plan, cfg: BuildConfig) -> Path:
    """trtllm-serve's YAML: the same LLM arguments as model.yaml, less the model (trtllm-serve's argument)."""
    jobs = plan_jobs(plan)
    limits = plan.limits
    kv_fraction = _kv_fraction(cfg)
    path = Path(plan.work_dir) / SERVE_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    serve_config = trtllm_serve_config(jobs[0], _draft_job(jobs), limits, kv_fraction, draft_len_schedule(cfg), cfg.ngram)
    path.write_text(serve_config.to_yaml(exclude=("model",)))
    return path


def plan_jobs(plan: Plan) -> list[ModelJob]:
    work = Path(plan.work_dir)
    return [
        ModelJob(m.role, m.spec, m.shape, work / "hf" / m.role, m.quant, m.kv_cache_dtype, m.tp, m.gpus, work / "trtllm" / m.role)  # type: ignore[arg-type]
        for m in (plan.target, plan.draft) if m is not None
    ]


def _flow(cfg: BuildConfig) -> str:
    """engine | llmapi (TensorRT-LLM), onnx (TensorRT)."""
    return cfg.backend.trtllm_flow if isinstance(cfg.backend, TrtllmBackend) else "onnx"


def _with_backend(cfg: BuildConfig, **changes) -> BuildConfig:
    return cfg.model_copy(update={"backend": cfg.backend.model_copy(update=changes)})


def _kv_fraction(cfg: BuildConfig) -> float:
    """Each model's share of free GPU memory for its KV cache: half each when the draft shares the GPU."""
    if cfg.backend.kv_cache_free_gpu_mem_fraction is not None:
        return cfg.backend.kv_cache_free_gpu_mem_fraction
    return SHARED_KV_FRACTION if cfg.backend.draft_placement == "shared" and not _prompt_lookup(cfg) else ALONE_KV_FRACTION


def _draft_job(jobs: list[ModelJob]) -> Optional[ModelJob]:
    return jobs[1] if len(jobs) > 1 else None


def _planned(job: ModelJob, cfg: BuildConfig, work: Path) -> PlannedModel:
    artifacts = job.engine_dir if cfg.backend.kind == "trtllm" else tensorrt_engine_dir(work, job.role)
    if _flow(cfg) == "llmapi":
        from specpipe.builder.trtllm import llmapi_model_dir

        artifacts = llmapi_model_dir(job)
    return PlannedModel(
        role=job.role, spec=job.spec, shape=job.shape, quant=job.quant, kv_cache_dtype=job.kv_cache_dtype, tp=job.tp, gpus=job.gpus,
        artifacts=str(artifacts),
    )  # fmt: skip


# ---- rendering --------------------------------------------------------------------------------------------


def render_plan(plan: Plan) -> str:
    """The plan as a person reads it: models, steps with their exact commands, files, memory per GPU."""
    lines = [f"GPU build plan: {plan.name} (backend {plan.backend}, flow {plan.flow})"]
    lines += ["  versions: " + ", ".join(f"{k} {v}" for k, v in plan.versions.items())]
    lines += ["  limits: " + ", ".join(f"{k}={v}" for k, v in plan.limits.model_dump().items())]
    for m in (plan.target, plan.draft):
        if m is None:
            lines.append("  draft  n-gram lookup in the request's own tokens (no draft model)")
            continue
        s = m.shape
        lines.append(
            f"  {m.role:6} {m.spec}: {s.params / 1e9:.2f}B params, {s.layers} layers, hidden {s.hidden}, heads {s.heads}/{s.kv_heads} kv,"
            f" vocab {s.vocab}; quant {m.quant}, KV {m.kv_cache_dtype}, tp {m.tp} on GPU {','.join(map(str, m.gpus))}"
        )
    lines.append("")
    lines.append("Steps (G = runs on a GPU):")
    for i, step in enumerate(plan.steps, 1):
        lines.append(f"  {i:2}. [{'G' if step.gpu else ' '}] {step.id}: {step.title}")
        if step.kind == "command" or step.call is not None:
            lines.append(f"        {step.display()}")
        if step.source:
            lines.append(f"        source: {step.source}")
    lines.append("")
    lines.append("Files written:")
    lines += [f"  {path}" for path in plan.files]
    lines.append("")
    lines.append(_render_memory(plan.memory))
    if plan.manifest is not None:
        lines += ["", _render_manifest(plan.manifest)]
    if plan.serve:
        lines += ["", "Serve (on the GPU machine):", "  " + " ".join(plan.serve)]
    if plan.notes:
        lines += ["", "Notes:"] + [f"  - {n}" for n in plan.notes]
    needs = plan.requirements()
    if needs:
        lines += ["", "Needs on the build machine: " + ", ".join(needs)]
    return "\n".join(lines)


def _render_manifest(manifest: Manifest) -> str:
    """The manifest the build writes last; `(at build)` marks what only the resolved checkpoints tell."""
    from specpipe.contract.manifest import MANIFEST as FILE

    lines = [f"Manifest ({FILE}, written last; --json shows it whole):"]
    for role in ("target", "draft"):
        entry = getattr(manifest, role)
        engine = getattr(entry, "engine", None)
        where = f"{engine.backend} {engine.graph} {engine.path}, quant {engine.quant}" if engine else f"{entry.kind} drafting"
        lines.append(f"  {role:6} {entry.source}: {where}")
    serving = manifest.serving
    lines.append(f"  serving max_batch_size {serving.max_batch_size}, draft schedule {schedule_text(serving.draft_schedule) if serving.draft_schedule else 'per request'};"
                 f" max_draft_len {manifest.max_draft_len}; tokenizer hash {manifest.tokenizer.hash}")
    return "\n".join(lines)


def _render_memory(memory: MemoryPlan) -> str:
    t, d = memory.target, memory.draft
    lines = [
        "GPU memory (estimate, GB = 1e9 bytes; see specpipe/builder/memory.py for the rules):",
        f"  target weights {t.weights_total_gb:.1f} GB in all, {t.weights_gb:.2f} per rank x {t.tp}; KV {t.kv_bytes_per_token} B/token/rank x {t.kv_tokens} tokens",
    ]
    if d is not None:
        lines.append(
            f"  draft  weights {d.weights_total_gb:.1f} GB in all, {d.weights_gb:.2f} per rank x {d.tp}; KV {d.kv_bytes_per_token} B/token/rank x {d.kv_tokens} tokens"
        )
    lines += [
        f"  {'GPU':>3}  {'weights':>8}  {'KV cache':>8}  {'reserve':>7}  {'total':>7}  models",
    ]
    for g in memory.gpus:
        lines.append(
            f"  {g.gpu:>3}  {g.weights_gb:8.2f}  {g.kv_cache_gb:8.2f}  {g.reserve_gb:7.2f}  {g.total_gb:7.2f}  {', '.join(g.models)}"
        )
    if memory.gpu_memory_gb is not None:
        verdict = "fits" if memory.fits else "does NOT fit"
        lines.append(f"  busiest GPU {memory.peak_gb:.1f} GB of {memory.gpu_memory_gb:g} GB: {verdict}")
    return "\n".join(lines)
