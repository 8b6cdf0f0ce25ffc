"""`specpipe build`: resolve a draft/target pair, check it, export both to engines, write the manifest.

Everything is built in a hidden temp folder next to the output and renamed into place at the end, so a
failed build leaves no half-written engines/<name>.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

from specpipe.config import BuildConfig
from specpipe.engines.onnxruntime import TARGET_MIN_ROWS, OrtEngine, optimize_for_cpu, write_engine_meta
from specpipe.errors import ExportError, OutputExistsError, UsageError
from specpipe.export.onnx import check_export, export_onnx
from specpipe.manifest import file_hashes, library_versions, now_iso, write_manifest

Progress = Callable[[str], None]
SERVED_MODEL = "ensemble"  # the model name TensorRT-LLM's Triton clients ask for by default


def default_name(target: str, draft: str) -> str:
    def short(spec: str) -> str:
        stem = Path(spec.rstrip("/")).name
        stem = stem[:-5] if stem.endswith(".gguf") else stem
        return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.") or "model"

    return f"{short(target)}--{short(draft)}"


def build(cfg: BuildConfig, progress: Optional[Progress] = None) -> Path:
    """Build engines/<name>/ (and the Triton repository when cfg.repo_dir is set). Returns the folder."""
    from specpipe.checkpoint import check_pair, inspect_checkpoint, load_tokenizer, resolve_checkpoint, tokenizer_hash

    say = progress or (lambda msg: None)
    name = cfg.name or default_name(cfg.target, cfg.draft)
    final = Path(cfg.engines_dir) / name
    if final.exists() and not cfg.force:
        raise OutputExistsError(f"{final} exists; pass --force to replace it")
    if cfg.repo_dir is not None and (Path(cfg.repo_dir) / SERVED_MODEL).exists() and not cfg.force:
        raise OutputExistsError(f"{Path(cfg.repo_dir) / SERVED_MODEL} exists; pass --force to replace it")
    from specpipe.quantize import check_kv_cache_dtype

    check_kv_cache_dtype(cfg.quant, cfg.backend)  # refuse, never silently ignore, a KV precision we cannot do
    if cfg.draft_vocab and cfg.draft_kind != "model":
        raise UsageError(f"--draft-vocab applies to a draft model; --draft {cfg.draft} has no head of its own")
    started = time.perf_counter()

    say(f"resolving target {cfg.target}")
    target = resolve_checkpoint(cfg.target, allow_pickle=cfg.allow_pickle)
    draft = None  # prompt lookup and self-drafts have no checkpoint of their own
    if cfg.draft_kind == "model":
        say(f"resolving draft {cfg.draft}")
        draft = resolve_checkpoint(cfg.draft, allow_pickle=cfg.allow_pickle)
        say("checking the pair is compatible")
        check_pair(target.path, draft.path)
    draft_vocab = _draft_vocab(cfg, target, draft)

    Path(cfg.engines_dir).mkdir(parents=True, exist_ok=True)
    with _staging(final) as stage:
        tokenizer = load_tokenizer(target.path)
        tokenizer.save_pretrained(str(stage / "tokenizer"))
        timings: dict[str, float] = {}
        target_entry = _build_engine(target, stage / "target", cfg, cfg.quant, tokenizer, say, timings, "target")
        target_entry["min_rows_per_call"] = TARGET_MIN_ROWS
        target_entry["verify_consistency"] = _measure_verify_consistency(stage / "target", cfg, tokenizer, say, timings)
        if cfg.draft_kind == "ngram":
            draft_entry = {"kind": "ngram", "source": "ngram", "ngram": cfg.ngram.model_dump()}
        elif cfg.draft_kind == "self":
            draft_entry = _build_self_draft(stage, cfg, tokenizer, say, timings, target_entry)
        elif draft.weights_sha256 == target.weights_sha256 and cfg.draft_quant == cfg.quant and draft_vocab is None:
            say("draft is the target: reusing its engine")
            shutil.copytree(stage / "target", stage / "draft", copy_function=_link_or_copy)
            draft_entry = {**target_entry, "source": draft.source, "engine": {**target_entry["engine"], "path": "draft"}}
        else:
            draft_entry = _build_engine(draft, stage / "draft", cfg, cfg.draft_quant, tokenizer, say, timings, "draft",
                                        draft_vocab)
        say("timing the engines for adaptive K")
        costs = _measure_step_costs(stage, cfg, has_draft_engine=cfg.draft_kind != "ngram")
        timings["total_s"] = time.perf_counter() - started
        write_manifest(
            stage,
            {
                "name": name,
                "created": now_iso(),
                "specpipe_version": library_versions()["specpipe"],
                "versions": library_versions(),
                "build": json.loads(cfg.model_dump_json()),
                "tokenizer": {"path": "tokenizer", "hash": tokenizer_hash(tokenizer)},
                "eos_token_ids": sorted(inspect_checkpoint(target.path).eos_token_ids),
                "max_draft_len": cfg.max_draft_len,
                "step_costs": costs.as_dict(),
                "target": target_entry,
                "draft": {"kind": "model", **draft_entry},  # ngram / self entries carry their own kind
                "timings_s": timings,
            },
        )
    say(f"wrote {final} in {time.perf_counter() - started:.1f} s")
    if cfg.repo_dir is not None:
        from specpipe.triton.repository import write_repository

        model_dir = write_repository(final, Path(cfg.repo_dir), instance_count=cfg.triton_instances,
                                     model_name=SERVED_MODEL, force=True)
        say(f"wrote the Triton model repository {model_dir}")
    return final


def _draft_vocab(cfg: BuildConfig, target, draft) -> Optional[dict]:
    """The draft head's columns (checkpoint/draft_vocab.py), chosen before any expensive step."""
    if draft is None:
        return None
    from specpipe.checkpoint import inspect_checkpoint
    from specpipe.checkpoint.draft_vocab import choose_token_ids

    eos = inspect_checkpoint(target.path).eos_token_ids
    return choose_token_ids(draft.path, cfg.draft_vocab, inspect_checkpoint(draft.path).vocab_size, always=eos)


def _build_engine(ckpt, out: Path, cfg: BuildConfig, qcfg, tokenizer, say: Progress, timings: dict, role: str,
                  vocab: Optional[dict] = None) -> dict:
    """Export one checkpoint, optimize it for ONNX Runtime, slice its head to `vocab` (a draft), check it
    against torch, then quantize it.

    A quantized engine keeps its unquantized reference beside it (<role>-fp32) so `validate --remeasure`
    can measure its accuracy again; the manifest records the accuracy numbers and the budget."""
    from specpipe.checkpoint import inspect_checkpoint, load_causal_lm

    info = inspect_checkpoint(ckpt.path)
    t0 = time.perf_counter()
    say(f"exporting {role} to ONNX (optimum, {info.num_layers} layers)")
    with tempfile.TemporaryDirectory(prefix="specpipe-export-") as raw:
        export_onnx(ckpt.path, Path(raw))
        timings[f"{role}_export_s"] = time.perf_counter() - t0
        say(f"optimizing the {role} graph for ONNX Runtime")
        optimize_for_cpu(Path(raw) / "model.onnx", out, threads=cfg.threads)
    if vocab is not None:
        from specpipe.quantize.graph import load_model, model_files, save_model, slice_lm_head

        say(f"slicing the {role} head to its {vocab['size']} most used tokens")
        model = load_model(out)
        try:
            slice_lm_head(model, vocab["token_ids"])
        except ValueError as err:
            raise ExportError(f"cannot slice the {role} head ({err}); pass --draft-vocab 0") from None
        for path in model_files(out):
            path.unlink()
        save_model(model, out)
        del model
    write_engine_meta(
        out,
        vocab_size=info.vocab_size if vocab is None else vocab["size"],
        **({} if vocab is None else {"token_ids": vocab["token_ids"].tolist()}),
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        max_seq_len=min(int(info.max_position_embeddings or 2048), 8192),
        quant="none",
        ort_optimized=True,
    )
    t1 = time.perf_counter()
    say(f"checking the {role} engine against torch")
    max_abs_diff = check_export(
        load_causal_lm(ckpt.path, allow_pickle=cfg.allow_pickle),
        OrtEngine(out, threads=cfg.threads),
        tolerance=cfg.export_tolerance,
        name=role,
    )
    timings[f"{role}_check_s"] = time.perf_counter() - t1
    entry = {
        "source": ckpt.source,
        "resolved_path": str(ckpt.path),
        "weights_sha256": ckpt.weights_sha256,
        "checkpoint": info.model_dump(mode="json"),
        "engine": {"path": out.name, "backend": "onnxruntime", "quant": qcfg.mode, "files": {}},
        "export_check": {"max_abs_diff": max_abs_diff, "tolerance": cfg.export_tolerance},
    }
    if vocab is not None:
        entry["vocab"] = {k: v for k, v in vocab.items() if k != "token_ids"}
    if qcfg.mode != "none":
        from specpipe.quantize import quantize_engine

        t2 = time.perf_counter()
        reference = out.with_name(f"{role}-fp32")
        out.rename(reference)
        say(f"quantizing the {role} ({qcfg.mode}) and measuring its accuracy")
        entry["quant"] = {**quantize_engine(reference, out, qcfg, tokenizer, model_name=role, threads=cfg.threads),
                          "reference_path": reference.name}
        timings[f"{role}_quantize_s"] = time.perf_counter() - t2
    entry["engine"]["files"] = file_hashes(out)
    return entry


def _build_self_draft(stage: Path, cfg: BuildConfig, tokenizer, say: Progress, timings: dict, target_entry: dict) -> dict:
    """`--draft self:MODE`: the target's own engine, weight-only quantized, drafts for it.

    Quantized from the unquantized target engine (`target/`, or `target-fp32/` when --quant quantized the
    target). Its accuracy is measured and recorded but never fails the build: a draft's precision changes
    how often it is accepted, never the output.
    """
    from specpipe.config import QuantConfig
    from specpipe.quantize import quantize_engine

    mode = cfg.draft.removeprefix("self:")
    reference = (target_entry.get("quant") or {}).get("reference_path") or target_entry["engine"]["path"]
    t0 = time.perf_counter()
    say(f"quantizing the target ({mode}) as its own draft")
    quant = quantize_engine(stage / reference, stage / "draft", QuantConfig(mode=mode, accept_accuracy_loss=True),
                            tokenizer, model_name="self-draft", threads=cfg.threads)
    timings["draft_quantize_s"] = time.perf_counter() - t0
    return {
        "kind": "self",
        "source": f"{cfg.draft} of {target_entry['source']}",
        "engine": {"path": "draft", "backend": "onnxruntime", "quant": mode, "files": file_hashes(stage / "draft")},
        "quant": {**quant, "reference_path": reference},
    }


# Prompts on which the build checks that the target is one function (a code and a prose continuation).
CONSISTENCY_PROMPTS = ("def fibonacci(n):\n", "The capital of France is")


def _measure_verify_consistency(folder: Path, cfg: BuildConfig, tokenizer, say: Progress, timings: dict) -> dict:
    """How far the target's logits for a position move between a 1-token decode and a verify call of
    K+1 = 5 tokens (engines/consistency.py). Twice that must stay within the near-tie tolerance of the
    target's precision, or greedy speculative output is not guaranteed to equal target-only output: the
    manifest records it and the gate's greedy check reports it."""
    from specpipe.engines.consistency import verify_consistency
    from specpipe.speculative.equivalence import near_tie_tolerance

    t0 = time.perf_counter()
    say("checking the target scores a position alike alone and inside a verify call")
    engine = OrtEngine(folder, threads=cfg.threads, min_rows=TARGET_MIN_ROWS)
    prompts = [tokenizer(prompt)["input_ids"] for prompt in CONSISTENCY_PROMPTS]
    result = verify_consistency(engine, [ids for ids in prompts if ids], new_tokens=24, chunk=5)
    tolerance = near_tie_tolerance(cfg.quant.mode)
    within = 2 * result.max_abs_logit_diff <= tolerance
    if not within:
        say(f"warning: the {cfg.quant.mode} target's logits differ by up to {result.max_abs_logit_diff:.3g} between a"
            f" 1-token decode and a verify call (near-tie tolerance {tolerance:g}): speculative greedy output may"
            " differ from target-only output")
    timings["target_consistency_s"] = time.perf_counter() - t0
    return {**result.as_dict(), "near_tie_tolerance": tolerance, "within_tolerance": within}


def _measure_step_costs(stage: Path, cfg: BuildConfig, has_draft_engine: bool):
    """Draft and verification costs relative to a target step, on these engines and this machine: adaptive
    K's inputs (speculative/adaptive.py). Recorded once, so every process serving the build drafts alike."""
    from specpipe.speculative.adaptive import measure_step_costs

    target = OrtEngine(stage / "target", threads=cfg.threads, min_rows=TARGET_MIN_ROWS)
    draft = OrtEngine(stage / "draft", threads=cfg.threads) if has_draft_engine else None
    return measure_step_costs(target, draft)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


@contextmanager
def _staging(final: Path):
    """A hidden temp folder beside `final`; renamed onto it on success, removed on any failure."""
    stage = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield stage
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            final.rename(old)
            stage.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            stage.rename(final)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
