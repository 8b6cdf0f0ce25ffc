"""The manifest of a TensorRT-LLM build: the same typed `Manifest` a CPU build writes, so `specpipe validate`,
bench and a person reading engines/<name>/manifest.json find the same fields.

A plan (dry run) holds the manifest the build would write, every field that needs the resolved checkpoints
(hashes, the tokenizer's EOS ids, the checkpoint's inspection) marked as to come; the real build's `manifest`
step fills them in and writes it last, after every GPU step succeeded, so a failed build leaves none.

What a TensorRT-LLM engine record means: `path` is the folder TensorRT-LLM loads (llmapi flow: the Hugging Face
folder, ModelOpt's quantized export when quantized; engine flow: the trtllm-build engine folder), `graph` says
which (`hf` or `trtllm-engine`). Such a deployment is served by trtllm-serve or Triton on a GPU; it cannot be
opened in this process (specpipe.deployment refuses it in one line): gate it with `validate --endpoint`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from specpipe.contract.manifest import (
    SERVED_BY,
    EngineRecord,
    Manifest,
    ModelEntry,
    ServingRecord,
    TokenizerRecord,
)
from specpipe.drafts.model import ModelDraft
from specpipe.drafts.ngram import NgramDraft

if TYPE_CHECKING:
    from specpipe.builder.config import BuildConfig
    from specpipe.builder.plan import Plan, PlannedModel

AT_BUILD = "(at build)"  # a value the dry run cannot know: computed from the resolved checkpoint by the real build


def engine_record(model: "PlannedModel", work: Path, flow: str, files: Optional[dict[str, str]] = None) -> EngineRecord:
    artifacts = Path(model.artifacts)
    path = artifacts.relative_to(work) if artifacts.is_relative_to(work) else artifacts
    return EngineRecord(path=str(path), backend="trtllm", quant=model.quant,  # type: ignore[arg-type]
                        graph="hf" if flow == "llmapi" else "trtllm-engine", files=files or {})


def serving_record(plan: "Plan", cfg: "BuildConfig") -> ServingRecord:
    """In-flight batching limits, and the draft length by batch size as the emitted speculative_config makes
    TensorRT-LLM run it, in specpipe's one schedule format (contract/decoding.py: "up to batch b: K; above the last: 0"): Eagle3's
    draft_len_schedule, else K up to max_concurrency. The engine flow: K is chosen per request (None)."""
    from specpipe.builder.plan import _draft_job, _kv_fraction, draft_len_schedule, plan_jobs
    from specpipe.builder.trtllm import trtllm_serve_config

    schedule = None
    if plan.flow == "llmapi":
        jobs = plan_jobs(plan)
        spec = trtllm_serve_config(jobs[0], _draft_job(jobs), plan.limits, _kv_fraction(cfg), draft_len_schedule(cfg),
                                   cfg.ngram).speculative_config
        upto = getattr(spec, "draft_len_schedule", None)
        if upto is None:
            upto = {spec.max_concurrency if spec.max_concurrency is not None else plan.limits.max_batch_size: spec.max_draft_len}
        schedule = dict(sorted(upto.items()))
    return ServingRecord(max_batch_size=plan.limits.max_batch_size, max_queue=0, draft_schedule=schedule)


def plan_manifest(plan: "Plan", cfg: "BuildConfig") -> Manifest:
    """The manifest as the dry run can know it: hashes, EOS ids and checkpoint facts are AT_BUILD / empty."""
    work = Path(plan.work_dir)
    entries = {m.role: ModelEntry(source=m.spec, engine=engine_record(m, work, plan.flow),
                                  checkpoint={"shape": m.shape.model_dump(mode="json"), "kv_cache_dtype": m.kv_cache_dtype, "tp": m.tp})
               for m in (plan.target, plan.draft) if m is not None}  # fmt: skip
    return Manifest.new(
        name=plan.name, build=json.loads(cfg.model_dump_json()), tokenizer=TokenizerRecord(path="tokenizer", hash=AT_BUILD),
        max_draft_len=plan.limits.max_draft_len, serving=serving_record(plan, cfg), target=entries["target"],
        draft=ModelDraft.of(entries["draft"]) if "draft" in entries else NgramDraft(ngram=cfg.ngram),
        warnings=[f"served by {SERVED_BY}", "step costs are not measured: TensorRT-LLM schedules draft lengths itself"],
    )  # fmt: skip


def built_manifest(plan: "Plan", cfg: "BuildConfig") -> Manifest:
    """The plan's manifest with what the resolved checkpoints and the built artifacts say."""
    from specpipe.checkpoint import inspect_checkpoint, load_tokenizer, tokenizer_hash, weights_sha256
    from specpipe.contract.manifest import file_hashes

    work = Path(plan.work_dir)
    manifest = plan_manifest(plan, cfg)
    updates: dict = {}
    for model in (plan.target, plan.draft):
        if model is None:
            continue
        checkpoint = work / "hf" / model.role
        folder = Path(model.artifacts)
        entry = getattr(manifest, model.role)
        filled = entry.model_copy(update={
            "resolved_path": str(checkpoint.resolve()), "weights_sha256": weights_sha256(checkpoint),
            "checkpoint": {**entry.checkpoint, **inspect_checkpoint(checkpoint).model_dump(mode="json")},
            "engine": engine_record(model, work, plan.flow, file_hashes(folder) if folder.is_dir() else {}),
        })  # fmt: skip
        updates[model.role] = filled
    updates["tokenizer"] = TokenizerRecord(path="tokenizer", hash=tokenizer_hash(load_tokenizer(work / "tokenizer")))
    updates["eos_token_ids"] = sorted(inspect_checkpoint(work / "hf" / "target").eos_token_ids)
    return manifest.model_copy(update=updates)
