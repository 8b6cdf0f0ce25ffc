"""An EAGLE-3 head (`--draft HEAD_FOLDER`, a folder whose config.json names LlamaForCausalLMEagle3): drafts from the
target's own hidden states, so the target engine outputs the layers the head reads (export/features.py)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import ClassVar, Literal, Optional, Sequence

from pydantic import Field

from specpipe.checkpoint.eagle3 import WEIGHTS_FILE, read_eagle3_head
from specpipe.contract.decoding import DecodingPolicy
from specpipe.contract.drafts import DISTILL_RECORD
from specpipe.contract.manifest import DraftEntry, Prediction, file_hashes
from specpipe.drafts.base import DraftKind
from specpipe.engines import Engine
from specpipe.errors import EngineError, UsageError
from specpipe.speculative.eagle3 import Eagle3Drafter


class Eagle3Decoding(DecodingPolicy):
    """TensorRT-LLM's Eagle3DecodingConfig: one-model EAGLE-3 also takes the batch schedule (draft_len_schedule)."""

    decoding_type = "Eagle3"
    backends = ("onnxruntime", "trtllm")


class Eagle3Draft(DraftEntry):
    """An EAGLE-3 head (upstream's format, copied as given into `path`) drafting from the target's features: the
    target engine outputs `feature_layers` (its engine.json says the same)."""

    kind: Literal["eagle3"] = "eagle3"
    source: str
    path: str = "draft"  # the head's folder (config.json, model.safetensors), relative to the build folder
    feature_layers: list[int]  # layer-output ids (export/features.py) the head reads
    draft_vocab_size: int  # the target tokens the head scores (its lm_head rows)
    # the runtime and dtype its matrices run in (engines/eagle3_head.py HEAD_DTYPES: torch, or "ort-" ONNX Runtime),
    # the fastest timed on the build machine (fastest_head_dtype), with each candidate's ms per draft step; None
    # (older builds): chosen by the CPU's flags
    head_dtype: Optional[Literal["float32", "bfloat16", "int8", "ort-float32", "ort-int8"]] = None
    head_step_ms: dict[str, float] = Field(default_factory=dict)
    files: dict[str, str] = Field(default_factory=dict, description="file name -> sha256")
    prediction: Optional[Prediction] = None
    policy: ClassVar = Eagle3Decoding

    def paths(self) -> list[str]:
        return [self.path]


class Eagle3Kind(DraftKind):
    name = "eagle3"
    entry = Eagle3Draft
    has_engine = True
    reads_target_features = True

    @classmethod
    def claims(cls, spec):
        return read_eagle3_head(spec) is not None

    @classmethod
    def drafter(cls, folder, entry, target, threads):
        return head_drafter(folder / entry.path, target, target.folder, dtype=entry.head_dtype or "auto")

    @classmethod
    def build(cls, spec, out, ctx):
        """A head is used as given: its config, its weights (and its distill record) copied into out/draft."""
        out = out / "draft"
        ctx.say(f"copying the EAGLE-3 head {spec} (it reads target layers {list(ctx.feature_layers)})")
        out.mkdir(parents=True)
        for name in ("config.json", WEIGHTS_FILE, DISTILL_RECORD):
            if (Path(spec) / name).is_file():
                shutil.copy2(Path(spec) / name, out / name)
        head = read_eagle3_head(str(out))
        dtype, ms = _time_head(out, ctx)
        ctx.say(f"the head's draft step: {', '.join(f'{d} {t:.2f} ms' for d, t in ms.items())}; runs in {dtype}")
        return Eagle3Draft(kind="eagle3", source=spec, path=out.name, feature_layers=list(ctx.feature_layers),
                           draft_vocab_size=head.draft_vocab_size or ctx.target_entry.checkpoint.get("vocab_size"),
                           head_dtype=dtype, head_step_ms=ms, files=file_hashes(out))

    @classmethod
    def describe(cls, entry):
        runs_in = f", runs in {entry.head_dtype} (fastest timed here)" if entry.head_dtype else ""
        return [f"EAGLE-3 head {entry.source}: reads target layers {entry.feature_layers}, scores {entry.draft_vocab_size} "
                f"tokens{runs_in}"]


def _time_head(folder: Path, ctx) -> tuple[str, dict[str, float]]:
    """The head's dtype by measurement on this machine (`fastest_head_dtype`)."""
    from specpipe.engines import load_engine
    from specpipe.engines.eagle3_head import target_embedding

    t0 = time.perf_counter()
    ctx.say("timing the head's draft step in each dtype, each after a target step as in decoding")
    target = load_engine(ctx.stage / "target", threads=ctx.cfg.backend.threads)
    choice = fastest_head_dtype(folder, target_embedding(ctx.stage / "target"), feature_layers=ctx.feature_layers,
                                target=target)
    ctx.timings["head_dtype_s"] = time.perf_counter() - t0
    return choice


# int8 heads as the target's int8-wo: MatMulNBits, symmetric, blocks of 64 along the input (SmolLM2's head: 576, 1536
# and 1728 all divide). int4 (the body at 4 bits, the head at 8) was timed too: 0.77-0.80 ms against int8's 0.85-0.93 a
# step after a target call on the Zen 4 here, too little to risk acceptance for.
HEAD_INT8_BLOCK = 64


def open_head(folder: str | Path, target_embedding, *, dtype: str = "float32",
              feature_layers: Optional[Sequence[int]] = None):
    """The head in `folder` as the runtime `dtype` names (engines/eagle3_head.py HEAD_DTYPES; "auto": `head_dtype`'s
    guess): torch (engines/eagle3_head.py), or ONNX Runtime (engines/eagle3_onnx.py) over the head's graph, its
    matrices quantized here for "ort-int8"."""
    from specpipe.engines.eagle3_head import ORT_PREFIX, Eagle3Head, Eagle3HeadEngine, head_dtype

    dtype = head_dtype(dtype)
    if not dtype.startswith(ORT_PREFIX):
        return Eagle3HeadEngine(folder, target_embedding, dtype=dtype, feature_layers=feature_layers)
    from specpipe.engines.eagle3_onnx import Eagle3OnnxHead, head_graph

    spec = Eagle3Head(folder, target_embedding, feature_layers=feature_layers)
    model = head_graph(spec)
    if dtype == ORT_PREFIX + "int8":
        from specpipe.quantize.weight_only import quantize_weight_only

        model = quantize_weight_only(model, mode="int8-wo", group_size=HEAD_INT8_BLOCK)
    return Eagle3OnnxHead(spec, model, dtype=dtype)


def fastest_head_dtype(folder: str | Path, target_embedding, *, feature_layers: Optional[Sequence[int]] = None,
                       rounds: int = 3, target=None) -> tuple[str, dict[str, float]]:
    """The dtype whose draft step is fastest on this machine, timed here (engines/timing.py `head_step_ms`, the
    candidates in turn, `rounds` times, median): bf16 is emulated ~30x slower on a CPU without AVX512-BF16, and int8
    runs on FBGEMM's / oneDNN's int8 kernels, whose speed depends on VNNI. Returns (dtype, {dtype: ms}); a dtype
    torch cannot run here is left out. Any dtype keeps decoding lossless (the q it drafts from is what it computes);
    what it may change is acceptance (docs/eagle3.md: held-out agreement fp32 0.573, bf16 0.571, int8 0.569).
    `target`: the target engine, whose decode step then runs before each timed head step, as in decoding
    (engines/timing.py `head_step_ms`'s `between`): the head's weights come from memory, not a warm cache."""
    import statistics

    from specpipe.engines.eagle3_head import HEAD_DTYPES
    from specpipe.engines.timing import head_step_ms, target_step

    engines = {}
    for dtype in HEAD_DTYPES:
        try:
            engines[dtype] = open_head(folder, target_embedding, dtype=dtype, feature_layers=feature_layers)
        except (RuntimeError, ImportError, EngineError):  # cannot run here (no int8 kernels in this torch build,
            continue  # a graph ONNX Runtime refuses): not a candidate
    between = target_step(target) if target is not None else None
    times: dict[str, list[float]] = {dtype: [] for dtype in engines}
    for _ in range(rounds):
        for dtype, engine in engines.items():
            times[dtype].append(head_step_ms(engine, between=between))
    ms = {dtype: round(statistics.median(values), 4) for dtype, values in times.items()}
    return min(ms, key=ms.get), ms


def head_drafter(head_folder: Path, target: Engine, target_folder: Path, *, dtype: str = "auto") -> Eagle3Drafter:
    """An EAGLE-3 head (upstream's format) drafting for `target`, whose engine must output the head's feature
    layers (export/features.py). The head reads the target's input embedding from the target's graph. `dtype`:
    what its matrices run in (a build records the fastest it timed; "auto" without one; "measure": time them now)."""
    from specpipe.engines.eagle3_head import check_pairing, target_embedding

    info = read_eagle3_head(str(head_folder))
    if info is None:
        raise UsageError(f"--draft {head_folder} is not an EAGLE-3 head (config.json naming LlamaForCausalLMEagle3)")
    # A head that names no layers reads EAGLE-3's default ones (export/features.py), as upstream's loaders assume.
    layers = info.layers_to_capture or _default_feature_layers(target_folder)
    embedding = target_embedding(target_folder)
    if dtype == "measure":  # a head no build timed (generate/bench --draft HEAD): the fastest here
        dtype, _ = fastest_head_dtype(head_folder, embedding, feature_layers=layers, target=target)
    head = open_head(head_folder, embedding, dtype=dtype, feature_layers=layers)
    check_pairing(head, getattr(target, "feature_layers", ()), target.vocab_size, target_folder)
    return Eagle3Drafter(head, target.vocab_size)


def _default_feature_layers(target_folder: Path) -> tuple[int, ...]:
    from specpipe.engines.base import read_engine_meta
    from specpipe.export.features import default_layers

    try:
        return default_layers(int(read_engine_meta(target_folder)["num_layers"]))
    except ValueError as err:
        raise UsageError(f"the head names no feature layers and EAGLE-3's defaults do not fit this target: {err}") from None
