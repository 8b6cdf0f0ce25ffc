"""`specpipe distill`'s config: what to train, on what data, with which budgets."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

from pydantic import Field, model_validator

from specpipe.config import THREADS, Strict, Threads


DistillData = Literal["answers", "stdlib"]


DistillDtype = Literal["auto", "float32", "bfloat16", "float16"]
VerdictQuant = Literal["none", "int8-wo", "int4-wo"]  # build's --quant modes the verdict can time a target at

# Training settings whose best value differs by --kind; a DistillConfig field left unset takes its kind's value.
# eagle3: a ~10M-weight head learns most per token with small batches and a higher rate, and from prompt positions
# weighted as answers (docs/eagle3.md sections 2 and 3m measure both); a time budget's best split for it gave the
# answers 0.39-0.5 of the minutes on the CPUs measured (3k, 3x, 3y: 0.6 lost 0.022 at position 1 in 3k's sweep).
DISTILL_KIND_DEFAULTS: dict[str, dict[str, float]] = {
    "model": {"lr": 1e-3, "batch_tokens": 4096, "prompt_weight": 0.2, "data_fraction": 0.6},
    "eagle3": {"lr": 3e-3, "batch_tokens": 1024, "prompt_weight": 1.0, "data_fraction": 0.45},
}
# Settings whose value differs by where the run goes (the resolved --device), over the kind's. On a GPU, 48 prompts a
# batch and 1,024-token steps leave it mostly idle; the H200 run (docs/gpu.md) answered 256 prompts at once (4.4k
# answer tokens/s) and trained an EAGLE-3 head on 4,096-token steps (89k tokens/s, held-out 0.645 at position 1).
# Those sizes ran there; other sizes were not timed on a GPU.
# On a CPU a teacher's rows are chosen by measurement among ANSWER_BATCH_CANDIDATES (distill/teachers.py
# `choose_answer_rows`), torch and ONNX teachers alike: on an Intel with AMX (2 cores, 2026-12-07) torch bf16 answered
# 375 / 475 / 515 / 502 tokens/s at 48 / 96 / 144 / 192 prompts at once; on a Zen 4 (session 53) the ONNX int8-wo
# teacher, which wins the run-off there, 391 / 411 / 426 at 48 / 96 / 144. --answer-batch fixes the rows.
DISTILL_DEVICE_DEFAULTS: dict[str, dict[str, dict[str, float]]] = {
    "cpu": {"model": {"answer_batch": 48}, "eagle3": {"answer_batch": 48}},
    "cuda": {"model": {"answer_batch": 256}, "eagle3": {"answer_batch": 256, "batch_tokens": 4096}},
}
ANSWER_BATCH_CANDIDATES = {"cpu": [48, 96, 144]}
# With a work budget, training's least share of its minutes when the phases before it overran theirs (a run that
# trains nothing is not worth its minutes); the answers stop at their own share, so only loading and probing can.
TRAIN_FLOOR = 0.1


def _cuda_visible() -> bool:
    """Whether --device auto will run on CUDA (specpipe.distill.precision.resolve_device's rule)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


class DistillConfig(Strict):
    """`specpipe distill`: train a small draft for a target on CPU, toward the target's next-token distribution.

    The time budget covers both phases: generating the target's answers to training prompts (a share
    `data_fraction`, skipped when cached answers already used it) and training on them.
    """

    target: str
    out: Path
    layers: int = Field(2, ge=1, le=64, description="decoder layers of the draft (evenly spaced target layers to start)")
    width: int = Field(
        0, ge=0, description="hidden size of the draft; 0 = the target's: embedding, head and layers start as the "
        "target's (narrower: projected onto the target's principal directions)"
    )
    minutes: float = Field(
        12.0, gt=0, description="time budget in minutes: target answers + training; with --answer-tokens/--train-tokens "
        "a cap on the whole run, not the budget: counted from its start, the answers stop at their share of the minutes, "
        "training at their end (then held-out scoring and the verdict)"
    )
    answer_tokens: Optional[int] = Field(
        None, ge=1, description="work budget: generate target answers until they hold this many tokens (the same data "
        "on any machine; default: as many as --minutes allows)"
    )
    train_tokens: Optional[int] = Field(
        None, ge=1, description="work budget: train on this many tokens (the same training on any machine; default: "
        "as many as --minutes allows)"
    )
    data_fraction: Optional[float] = Field(
        None, ge=0.0, lt=1.0, description="share of --minutes for generating target answers (the rest trains); "
        "default by --kind: model 0.6, eagle3 0.45; a time-budget run says when its own rates called for another"
    )
    seed: int = 0
    data: list[DistillData] = Field(
        default_factory=lambda: ["answers"], min_length=1,
        description="answers: the target's own answers to training prompts; stdlib: Python standard library source",
    )
    prompts: Optional[Path] = Field(None, description='extra training prompts, JSONL lines with {"prompt": ...}')
    max_answer_tokens: int = Field(160, ge=8, description="longest target answer generated for training")
    answer_batch: Optional[int] = Field(None, ge=1, description="prompts the target answers at once; default by "
                                        "device: on a CPU the teacher's fastest of 48, 96, 144 measured (48 unless "
                                        "more answer 1.05x as fast); 256 on a GPU")
    answer_batches: Optional[list[Annotated[int, Field(ge=1)]]] = Field(
        None, min_length=1, description="the teacher's rows to choose from by measurement (the first: the run-off's); default "
        "by device, or [--answer-batch] when that is given")
    sample_temperature: float = Field(0.7, gt=0.0, description="temperature of answers after the greedy first pass")
    teacher_top_k: int = Field(32, ge=1, description="target probabilities kept per position")
    teacher_engine: Literal["auto", "torch", "onnx"] = Field(
        "auto", description="what answers the training prompts: torch: the checkpoint in transformers, in --teacher-dtype; "
        "onnx: the target as build exports it, in ONNX Runtime (batched KV-cache decoding, the deployed target's own "
        "distributions and features; CPU, --data answers), at each --verdict-quant precision (the engines the verdict "
        "times, exported once); auto: time a short probe of each on this machine and keep the fastest"
    )
    teacher_dtype: DistillDtype = Field(
        "auto", description="precision the torch teacher answers in; auto: time each on this machine for a second, keep "
        "the faster"
    )
    train_dtype: DistillDtype = Field(
        "auto", description="precision of the draft's training matmuls (autocast; weights stay fp32); auto: measured as above"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the target answers and the draft trains; "
                                                   "auto: CUDA when torch sees a GPU")
    lr: Optional[float] = Field(None, gt=0.0, description="peak learning rate (AdamW, cosine over the budget); default "
                                "by --kind: model 1e-3, eagle3 3e-3")
    batch_tokens: Optional[int] = Field(None, ge=64, description="tokens per training step; default by --kind: model "
                                        "4096, eagle3 1024 (4096 on a GPU)")
    prompt_weight: Optional[float] = Field(
        None, ge=0.0, description="loss weight of a prompt position (an answer position weighs 1; the shared chat "
        "prefix 0): the teacher pass has the target's distribution there for free; default by --kind: model 0.2, eagle3 1.0"
    )
    negatives: int = Field(2048, ge=0, description="random vocabulary entries scored with the teacher's top-k each step")
    checkpoint_every: int = Field(50, ge=1, description="steps between saved training states (for --resume)")
    resume: bool = Field(False, description="continue a stopped run from OUT's saved training state")
    force: bool = Field(False, description="replace an existing OUT")
    threads: Threads = Field(THREADS, description="torch threads")
    verdict_quant: list[VerdictQuant] = Field(
        ["none"], min_length=1, description="target precisions the closing verdict times the target at (build's --quant "
        "modes, none = fp32): a quantized target steps faster, the draft does not; give the ones build will consider"
    )
    verdict: bool = Field(
        True, description="close by timing the written draft and the target as ONNX Runtime engines on this machine's "
        "CPU and predicting the speedup; off on a machine that will not deploy the draft (a GPU trains a head for CPU "
        "servers): the record then says it cannot predict, and build measures the speedup where it deploys"
    )
    # ---- --kind: what is trained (specpipe/distill/eagle3.py for eagle3) ----
    kind: Literal["model", "eagle3"] = Field(
        "model", description="model: a small Llama draft (its own layers and embedding); eagle3: an EAGLE-3 head that "
        "reads the target's hidden states (written in upstream's EAGLE-3 checkpoint format)"
    )
    feature_layers: Optional[list[int]] = Field(
        None, description="eagle3: target layers whose outputs the head reads (0-based layer-output ids, SGLang / "
        "TensorRT-LLM numbering); default 1, N/2-1, N-4"
    )
    head_vocab: int = Field(8192, ge=16, description="eagle3: draft vocabulary of the head (the most frequent answer tokens)")
    ttt_steps: int = Field(3, ge=1, le=16, description="eagle3: training-time test, steps the head is unrolled on its own states")
    ttt_decay: float = Field(0.8, gt=0.0, le=1.0, description="eagle3: loss weight of unrolled step k is decay^k (normalized)")
    warm_start: bool = Field(True, description="eagle3: start lm_head rows, final norm and MLP from the target's")
    warm_attention: bool = Field(True, description="eagle3, with --warm-start: start the attention from the target's "
                                 "last layer too (on the feature half of its input)")
    init_head: Optional[Path] = Field(
        None, description="eagle3: start from this head's weights (upstream's EAGLE-3 format, made for the same target "
        "and feature layers; its draft vocabulary is kept) and train it further on a new budget"
    )

    @model_validator(mode="before")
    @classmethod
    def _kind_defaults(cls, values):
        if isinstance(values, dict):
            kind = values.get("kind", "model")
            device = values.get("device", "auto")
            if device == "auto":
                device = "cuda" if _cuda_visible() else "cpu"
            defaults = {**DISTILL_KIND_DEFAULTS.get(kind, {}), **DISTILL_DEVICE_DEFAULTS.get(device, {}).get(kind, {})}
            unset = {name: value for name, value in defaults.items() if values.get(name) is None}
            if values.get("answer_batches") is None:  # a given --answer-batch is the only candidate
                given = values.get("answer_batch")
                rows = [given] if given is not None else ANSWER_BATCH_CANDIDATES.get(device) or [unset["answer_batch"]]
                if all(isinstance(r, int) and r >= 1 for r in rows):  # else answer_batch's own error names the flag
                    unset["answer_batches"] = rows
                unset["answer_batch"] = given if given is not None else rows[0]
            values = {**values, **unset}
        return values

    @property
    def starts_attention_warm(self) -> bool:
        """--warm-attention takes effect only with --warm-start (its copies sit on the warm start's fc and norms)."""
        return self.warm_start and self.warm_attention

    def train_budget_s(self, elapsed_s: float, trained_s: float = 0.0) -> float:
        """Seconds of training the run may reach, `elapsed_s` into this process's run, `trained_s` of them already
        spent by an earlier one (--resume). A time budget splits --minutes: training gets its share (1 -
        data_fraction). A work budget (--train-tokens) makes --minutes a cap on the whole run: training ends where
        the minutes do, so it also uses what the answers left of their share (the session-15 demo's answers took 4
        of their 10.8 minutes, and training stopped at its 7.2-minute share with 669k of its 900k tokens), and
        loses what the phases before it took over theirs (loading, exporting, the teacher probe: they used to come
        on top, 102 s past the cap in the session-29 demo), never below TRAIN_FLOOR of its share."""
        share = self.minutes * 60 * (1 - self.data_fraction)
        if not self.train_tokens:
            return share
        return trained_s + max(TRAIN_FLOOR * share, self.minutes * 60 - elapsed_s)
