"""`specpipe build`: resolve a draft/target pair, check it, export both to engines, write the manifest.

Everything is built in a hidden temp folder next to the output and renamed into place at the end, so a
failed build leaves no half-written engines/<name>.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

from specpipe.builder.measure import (
    Candidate,
    measure_batch_costs,
    measure_built_draft_batch_costs,
    measure_built_step_costs,
    measure_candidates,
    measure_precisions,
    measure_step_costs,
    measure_target_min_rows,
    rows_per_call,
)
from specpipe.builder.config import BuildConfig
from specpipe.checkpoint.facts import CONTEXT_LENGTH_UNSAID
from specpipe.config import MAX_SEQ_LEN
from specpipe.checkpoint.eagle3 import read_eagle3_head
from specpipe.contract.drafts import DISTILL_RECORD
from specpipe.drafts import BuildContext, kind_named, kind_of, make_drafter
from specpipe.engines import load_engine
from specpipe.engines.onnxruntime import optimize_for_cpu, write_engine_meta
from specpipe.engines.shared_kv import KV_LAYOUT
from specpipe.errors import ExportError, OutputExistsError, UsageError
from specpipe.export.onnx import check_export, export_onnx
from specpipe.export.ortgenai_builder import run_model_builder
from specpipe.machine import available_memory_bytes, describe_machine, usable_cpus
from specpipe.contract.manifest import (
    ChoiceSample,
    ConsistencyRecord,
    DraftChoice,
    DraftEntry,
    EngineRecord,
    ExportCheck,
    Manifest,
    ModelEntry,
    Prediction,
    QuantCandidate,
    QuantRecord,
    ServingRecord,
    TokenizerRecord,
    VocabRecord,
    file_hashes,
    write_manifest,
)
from specpipe.contract.costs import StepCosts
from specpipe.triton.repository import DEFAULT_MODEL_NAME, write_repository

Progress = Callable[[str], None]


def build_cpu(cfg: BuildConfig, progress: Optional[Progress] = None) -> Path:
    """Build engines/<name>/ (and the Triton repository when cfg.repo_dir is set). Returns the folder.

    One --draft is built and deployed as given. Several are each built and measured against the target
    alone, and the fastest is deployed, or none (specpipe/builder/draft_choice.py); the others are not kept."""
    from specpipe.checkpoint import check_pair, inspect_checkpoint, load_tokenizer, resolve_checkpoint, tokenizer_hash

    say = progress or (lambda msg: None)
    name = cfg.output_name
    final = Path(cfg.engines_dir) / name
    if final.exists() and not cfg.force:
        raise OutputExistsError(f"{final} exists; pass --force to replace it")
    if cfg.repo_dir is not None and (Path(cfg.repo_dir) / DEFAULT_MODEL_NAME).exists() and not cfg.force:
        raise OutputExistsError(f"{Path(cfg.repo_dir) / DEFAULT_MODEL_NAME} exists; pass --force to replace it")
    _require_folders(cfg)
    from specpipe.quantize import check_kv_cache_dtype

    check_kv_cache_dtype(cfg.quant, cfg.backend.kind)  # refuse, never silently ignore, a KV precision we cannot do
    kinds = {spec: kind_of(spec) for spec in cfg.draft}
    for spec, kind in kinds.items():
        if not kind.entry.policy.supports_backend(cfg.backend.kind):
            raise UsageError(f"--draft {spec} (a {kind.name} draft) runs on {', '.join(kind.entry.policy.backends)}, "
                             f"not --backend {cfg.backend.kind}")
    if cfg.draft_vocab and not any(kind.has_checkpoint for kind in kinds.values()):
        raise UsageError(f"--draft-vocab applies to a draft model; --draft {', '.join(cfg.draft)} has no head of its own")
    started = time.perf_counter()

    say(f"resolving target {cfg.target}")
    target = resolve_checkpoint(cfg.target, allow_pickle=cfg.allow_pickle)
    models = {}  # draft checkpoints (prompt lookup, self-drafts and none have none of their own)
    for spec in (spec for spec, kind in kinds.items() if kind.has_checkpoint):
        say(f"resolving draft {spec}")
        models[spec] = resolve_checkpoint(spec, allow_pickle=cfg.allow_pickle)
        say("checking the pair is compatible")
        check_pair(target.path, models[spec].path)
    vocabs = {spec: _draft_vocab(cfg, target, draft) for spec, draft in models.items()}
    eos_token_ids = sorted(inspect_checkpoint(target.path).eos_token_ids)
    heads = [spec for spec, kind in kinds.items() if kind.reads_target_features]
    feature_layers = _head_feature_layers(heads, cfg, inspect_checkpoint(target.path)) if heads else None

    Path(cfg.engines_dir).mkdir(parents=True, exist_ok=True)
    with _staging(final) as stage:
        tokenizer = load_tokenizer(target.path)
        tokenizer.save_pretrained(str(stage / "tokenizer"))
        timings: dict[str, float] = {}
        target_entry = _build_engine(target, stage / "target", cfg, cfg.quant, tokenizer, say, timings, "target",
                                     feature_layers=feature_layers)
        if target_entry.verify_consistency is None:  # --quant auto measured it while choosing
            target_entry.verify_consistency, target_entry.min_rows_per_call = measure_target_min_rows(
                stage / "target", target_entry.engine.quant, cfg, tokenizer, say, timings)

        def build_draft(spec: str, out: Path, spent: dict) -> DraftEntry:
            """One --draft candidate's files in `out` (its engine in out/draft), by its kind's build step."""
            return kinds[spec].build(spec, out, BuildContext(
                cfg=cfg, stage=stage, target=target, target_entry=target_entry, tokenizer=tokenizer, say=say,
                timings=spent, checkpoint=models.get(spec), vocab=vocabs.get(spec), feature_layers=feature_layers,
                export=_build_engine, draft_graph=draft_graph))

        choice = None
        if cfg.choosing:
            draft_entry, costs, choice = _choose_draft(stage, cfg, kinds, build_draft, tokenizer, eos_token_ids, say,
                                                       target_entry.min_rows_per_call)
            warnings = _slow_candidates(choice, draft_entry)
        else:
            draft_entry = build_draft(cfg.draft[0], stage, timings)
            say("timing the engines for adaptive K")
            costs = measure_built_step_costs(stage, draft_entry, cfg, target_entry.min_rows_per_call)
            warnings = _predict(cfg.draft[0], draft_entry, models.get(cfg.draft[0]), costs, cfg)
        target_entry.verify_consistency, target_entry.min_rows_per_call = rows_per_call(
            target_entry.verify_consistency, target_entry.min_rows_per_call, draft_entry)
        say(f"timing batched target steps (up to {cfg.backend.max_batch_size} requests) for load-adaptive K")
        batch_costs = measure_batch_costs(load_engine(stage / "target", threads=cfg.backend.threads,
                                                      min_rows=target_entry.min_rows_per_call), cfg.backend.max_batch_size)
        draft_batch_costs = measure_built_draft_batch_costs(stage, draft_entry, cfg, say)
        timings["total_s"] = time.perf_counter() - started
        write_manifest(stage, Manifest.new(
            name=name, build=json.loads(cfg.model_dump_json()), tokenizer=TokenizerRecord(path="tokenizer", hash=tokenizer_hash(tokenizer)),
            eos_token_ids=eos_token_ids, max_draft_len=cfg.max_draft_len, step_costs=costs, batch_costs=batch_costs,
            draft_batch_costs=draft_batch_costs,
            serving=ServingRecord(max_batch_size=cfg.backend.max_batch_size, max_queue=cfg.backend.max_queue,
                                  draft_schedule=cfg.backend.draft_schedule),
            machine=describe_machine(cfg.backend.threads).as_dict(),  # where step_costs and timings_s were measured
            target=target_entry, draft=draft_entry, draft_choice=choice, warnings=warnings, timings_s=timings,
        ))  # fmt: skip
    say(f"wrote {final} in {time.perf_counter() - started:.1f} s")
    if cfg.repo_dir is not None:
        model_dir = write_repository(final, Path(cfg.repo_dir), instance_count=cfg.triton_instances,
                                     stream_interval=cfg.stream_interval, model_name=DEFAULT_MODEL_NAME, force=True)
        say(f"wrote the Triton model repository {model_dir}")
    return final



def _require_folders(cfg: BuildConfig) -> None:
    """--engines-dir and --repo-dir are folders or can be made: before minutes of exporting, not after."""
    for option, folder in (("--engines-dir", cfg.engines_dir), ("--repo-dir", cfg.repo_dir)):
        if folder is None:
            continue
        folder = Path(folder)
        blocker = next((path for path in (folder, *folder.parents) if path.exists() and not path.is_dir()), None)
        if blocker is not None:
            where = "" if blocker == folder else f" ({blocker} is a file)"
            raise UsageError(f"{option} {folder} is not a folder{where}")

def _head_feature_layers(heads: list[str], cfg: BuildConfig, info) -> tuple[int, ...]:
    """The target layers every --draft EAGLE-3 head reads (the target graph outputs them), refused in one line
    when the target's graph cannot output them or the heads disagree."""
    from specpipe.export.features import check_layers, default_layers

    wanted = {}
    for spec in heads:
        head = read_eagle3_head(spec)
        try:
            wanted[spec] = check_layers(head.layers_to_capture or default_layers(info.num_layers), info.num_layers)
        except ValueError as err:
            raise UsageError(f"--draft {spec} is an EAGLE-3 head this target cannot feed: {err}") from None
    if len(set(wanted.values())) > 1:
        raise UsageError("the --draft EAGLE-3 heads read different target layers ("
                         + "; ".join(f"{spec}: {list(layers)}" for spec, layers in wanted.items())
                         + "): one target engine outputs one set")
    layers = next(iter(wanted.values()))
    # The builder's graph outputs features, at fp32 and weight-only int8/int4 alike (quantize/pipeline.py
    # `quantize_with_builder` asks the builder for its source's feature layers); optimum's graph does not.
    refusal = builder_refusal(info, cfg.quant.mode)
    if refusal is None and target_graph(cfg, info) != "genai":
        refusal = f"--target-graph {cfg.backend.target_graph}" + (" (onnxruntime-genai is not installed)"
                                                                   if cfg.backend.target_graph == "auto" else "")
    if refusal:
        raise UsageError(f"--draft {heads[0]} is an EAGLE-3 head reading target layers {list(layers)}: only the "
                         f"builder graph (--target-graph genai; fp32, int8-wo, int4-wo) outputs them, not this target's ({refusal})")
    return layers


def _choose_draft(stage: Path, cfg: BuildConfig, kinds: dict, build_draft: Callable[[str, Path, dict], DraftEntry],
                  tokenizer, eos_token_ids: list[int], say: Progress,
                  target_min_rows: int) -> tuple[DraftEntry, StepCosts, DraftChoice]:
    """Build every candidate in stage/candidates/<i>, measure them all against the target alone, and move the
    chosen one's files into the stage; the others are removed with that folder.
    Returns (the chosen draft's manifest entry, its step costs, the manifest's `draft_choice`)."""
    from specpipe.builder import draft_choice

    target = load_engine(stage / "target", threads=cfg.backend.threads, min_rows=target_min_rows)
    alone = (load_engine(stage / "target", threads=cfg.backend.threads, min_rows=1) if target_min_rows > 1
             else target)  # "none" as deployed: unpadded (measure_candidates)
    candidates, entries, folders = [], {}, {}
    for index, spec in enumerate(cfg.draft):
        say(f"candidate {index + 1}/{len(cfg.draft)}: {spec}")
        folders[spec] = stage / "candidates" / str(index)
        folders[spec].mkdir(parents=True)
        spent: dict[str, float] = {}
        entries[spec] = build_draft(spec, folders[spec], spent)
        drafter = make_drafter(folders[spec], entries[spec], target, cfg.backend.threads)
        say(f"timing the engines of {spec} for adaptive K")
        costs = measure_step_costs(target, getattr(drafter, "engine", None), head=getattr(drafter, "head", None))
        candidates.append(Candidate(spec, kinds[spec].name, drafter, costs, source=entries[spec].source,
                                                 weights_sha256=getattr(entries[spec], "weights_sha256", None),
                                                 build_timings_s=spent))

    started = time.perf_counter()
    measurements = measure_candidates(target, candidates, tokenizer, eos_token_ids, cfg.choice,
                                        max_draft_len=cfg.max_draft_len, alone=alone, progress=say)
    chosen, reason = draft_choice.choose(measurements, cfg.choice.min_speedup)
    say(f"chose {chosen}: {reason}")
    choice = DraftChoice(
        chosen=chosen, reason=reason, min_speedup=cfg.choice.min_speedup,
        sample=ChoiceSample(prompt_sets=list(cfg.choice.choice_sets), prompts_per_set=cfg.choice.choice_prompts,
                            new_tokens=cfg.choice.choice_tokens, decoding="greedy, adaptive K"),
        candidates=measurements, wall_s=time.perf_counter() - started,
    )  # fmt: skip
    del candidates, target, alone  # the ONNX Runtime sessions, before their files move
    if chosen == draft_choice.NONE:
        entry = kind_named(draft_choice.NONE).entry()  # the target alone
        costs = measure_built_step_costs(stage, entry, cfg, target_min_rows)
    else:
        entry = entries[chosen]
        for path in folders[chosen].iterdir():
            path.rename(stage / path.name)
        costs = choice.measurement(chosen).step_costs
    shutil.rmtree(stage / "candidates")
    return entry, costs, choice


def _slow_candidates(choice: DraftChoice, entry: DraftEntry) -> list[str]:
    """One warning per measured model draft that adaptive K's model predicts below 1.0x (speculative/adaptive.py
    `predicted_speedup`, with the candidate's step costs and the acceptance measured on the sample); the
    deployed one's prediction is recorded in `entry`."""
    warnings = []
    for m in choice.candidates:
        if m.predicted_speedup is None:
            continue
        if m.predicted_speedup < 1.0:
            warnings.append(_slow_draft(m.draft, m.predicted_speedup, m.acceptance_rate, "measured acceptance", m.step_costs))
        if m.draft == choice.chosen:
            entry.prediction = Prediction(speedup=m.predicted_speedup, acceptance=m.acceptance_rate,
                                          acceptance_from="measured on the build's sample")
    return warnings


def _predict(spec: str, entry: DraftEntry, draft_ckpt, costs: StepCosts, cfg: BuildConfig) -> list[str]:
    """A single model draft's predicted speedup (adaptive K's model with this machine's step costs), when an
    earlier measurement gives its acceptance: its distill record's held-out agreement, or a self-draft's
    top-1 agreement. Recorded in `entry`; a warning when below 1.0x (the draft makes decoding slower)."""
    from specpipe.speculative.adaptive import predicted_speedup

    if not kind_named(entry.kind).has_engine:
        return []
    acceptance, source = _known_acceptance(entry, draft_ckpt)
    if acceptance is None:
        return []
    speedup = predicted_speedup(acceptance, costs, entry.policy(max_draft_len=cfg.max_draft_len).adaptive_ceiling)
    entry.prediction = Prediction(speedup=speedup, acceptance=acceptance, acceptance_from=source)
    return [_slow_draft(spec, speedup, acceptance, source, costs)] if speedup < 1.0 else []


def _known_acceptance(entry: DraftEntry, draft_ckpt) -> tuple[Optional[float], str]:
    """A single draft's expected per-token acceptance, when something measured it before this build: a self-draft's
    top-1 agreement (its quantization accuracy), a distilled checkpoint's record."""
    quant = getattr(entry, "quant", None)
    if entry.kind == "self":
        agreement = quant.accuracy.top1_agreement if quant.accuracy is not None else None
        return agreement, "top-1 agreement with the target (quantization accuracy)"
    record = Path(draft_ckpt.path) / DISTILL_RECORD if draft_ckpt is not None else None
    if record is None or not record.is_file():
        return None, ""
    agreement = json.loads(record.read_text()).get("held_out_agreement")
    return agreement, f"{DISTILL_RECORD} held_out_agreement"


def _slow_draft(spec: str, speedup: float, acceptance: float, source: str, costs) -> str:
    return (f"draft {spec} is predicted at {speedup:.2f}x the target alone on this machine (acceptance {acceptance:.2f} "
            f"from {source}, draft step {costs.draft:.2f} of a target step): it makes decoding slower")


def _draft_vocab(cfg: BuildConfig, target, draft) -> Optional[dict]:
    """The draft head's columns (checkpoint/draft_vocab.py), chosen before any expensive step."""
    if draft is None:
        return None
    from specpipe.checkpoint import inspect_checkpoint
    from specpipe.checkpoint.draft_vocab import choose_token_ids

    eos = inspect_checkpoint(target.path).eos_token_ids
    return choose_token_ids(draft.path, cfg.draft_vocab, inspect_checkpoint(draft.path).vocab_size, always=eos)


def _build_engine(ckpt, out: Path, cfg: BuildConfig, qcfg, tokenizer, say: Progress, timings: dict, role: str,
                  vocab: Optional[dict] = None, graph: Optional[str] = None,
                  feature_layers: Optional[tuple[int, ...]] = None) -> dict:
    """Export one checkpoint with `graph`'s exporter (None: the target's choice, target_graph), optimize it for
    ONNX Runtime, slice its head to `vocab` (a draft), check it against torch, then quantize it.
    `feature_layers`: the builder graph also outputs those layers' hidden states (an EAGLE-3 head's input).

    A quantized engine keeps its unquantized reference beside it (<role>-fp32) so `validate --remeasure`
    can measure its accuracy again; the manifest records the accuracy numbers and the budget."""
    from specpipe.checkpoint import inspect_checkpoint, load_causal_lm

    info = inspect_checkpoint(ckpt.path)
    t0 = time.perf_counter()
    graph = graph or (target_graph(cfg, info) if role == "target" else "optimum")
    if graph == "genai":
        say(f"exporting {role} to ONNX (onnxruntime-genai's model builder: shared KV buffer, {info.num_layers} layers)")
        with tempfile.TemporaryDirectory(prefix="specpipe-export-") as raw:
            run_model_builder(ckpt.path, Path(raw) / "out", "fp32", Path(raw) / "cache", feature_layers=feature_layers)
            out.mkdir(parents=True, exist_ok=True)
            for name in ("model.onnx", "model.onnx.data"):  # the runtime's genai_config.json is not ours to keep
                shutil.move(str(Path(raw) / "out" / name), out / name)
        timings[f"{role}_export_s"] = time.perf_counter() - t0
    else:
        say(f"exporting {role} to ONNX (optimum, {info.num_layers} layers)")
        with tempfile.TemporaryDirectory(prefix="specpipe-export-") as raw:
            export_onnx(ckpt.path, Path(raw))
            timings[f"{role}_export_s"] = time.perf_counter() - t0
            say(f"optimizing the {role} graph for ONNX Runtime")
            optimize_for_cpu(Path(raw) / "model.onnx", out, threads=cfg.backend.threads)
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
        max_seq_len=min(int(info.max_position_embeddings or CONTEXT_LENGTH_UNSAID), MAX_SEQ_LEN),
        quant="none",
        **({"kv_layout": KV_LAYOUT} if graph == "genai" else {"ort_optimized": True}),
        **({"feature_layers": list(feature_layers)} if feature_layers else {}),
    )
    t1 = time.perf_counter()
    say(f"checking the {role} engine against torch")
    max_abs_diff = check_export(
        load_causal_lm(ckpt.path, allow_pickle=cfg.allow_pickle),
        load_engine(out, threads=cfg.backend.threads),
        tolerance=cfg.backend.export_tolerance,
        name=role,
    )
    timings[f"{role}_check_s"] = time.perf_counter() - t1
    entry = ModelEntry(
        source=ckpt.source, resolved_path=str(ckpt.path), weights_sha256=ckpt.weights_sha256,
        checkpoint=info.model_dump(mode="json"),
        engine=EngineRecord(path=out.name, backend="onnxruntime", graph=graph, files={},
                            quant="none" if qcfg.mode == "auto" else qcfg.mode),  # auto: the kept mode, set below
        export_check=ExportCheck(max_abs_diff=max_abs_diff, tolerance=cfg.backend.export_tolerance),
    )  # fmt: skip
    if vocab is not None:
        entry.vocab = VocabRecord(**{k: v for k, v in vocab.items() if k != "token_ids"})
    if qcfg.mode != "none":
        from specpipe.quantize import quantize_engine

        t2 = time.perf_counter()
        reference = out.with_name(f"{role}-fp32")
        out.rename(reference)
        # The builder quantizes its own graph from the checkpoint; a sliced head exists only in the exported graph
        # (the builder would rebuild the full one), so specpipe's quantizer quantizes that graph instead.
        checkpoint = ckpt.path if graph == "genai" and vocab is None else None
        if qcfg.mode == "auto":
            entry.quant, entry.verify_consistency, entry.min_rows_per_call = _auto_quant(
                reference, out, qcfg, tokenizer, checkpoint, cfg, say, role, timings)
            entry.engine.quant = entry.quant.mode
        else:
            say(f"quantizing the {role} ({qcfg.mode}) and measuring its accuracy")
            entry.quant = QuantRecord(**quantize_engine(reference, out, qcfg, tokenizer, model_name=role,
                                                        threads=cfg.backend.threads, checkpoint=checkpoint),
                                      reference_path=reference.name)
        timings[f"{role}_quantize_s"] = time.perf_counter() - t2
    entry.engine.files = file_hashes(out)
    return entry


# The model builder's peak memory over the fp32 weights' bytes: 1.97 GB for SmolLM2-135M's 538 MB (3.7x; its int8-wo
# run, AMD EPYC Zen 3, 2026-11-29), rounded up.
BUILDER_PEAK_PER_WEIGHT_BYTE = 4.0


def quantizers_side_by_side(candidates: int, weights_bytes: int, cpus: Optional[int], available: Optional[int]) -> int:
    """How many of `--quant auto`'s candidates the model builder quantizes at once. Each runs on one core in a process
    of its own (SmolLM2-135M, 2-core AVX2 Zen 3: int8-wo 16 s, int4-wo's k-quant 67 s, ~1.0 core each), so one a
    core, as many as the memory available now holds at the builder's peak; one where either is unknown."""
    if not cpus or available is None:
        return 1
    fits = int(available // (BUILDER_PEAK_PER_WEIGHT_BYTE * max(weights_bytes, 1)))
    return max(1, min(candidates, cpus, fits))


def _auto_quant(reference: Path, out: Path, qcfg, tokenizer, checkpoint: Optional[Path], cfg: BuildConfig, say: Progress,
                role: str, timings: dict) -> tuple[QuantRecord, ConsistencyRecord, int]:
    """`--quant auto`: quantize `reference` (the fp32 engine) as each of AUTO_QUANT_CANDIDATES beside it, measure
    each one's accuracy against it, time them all with fp32 at the batch sizes the server runs, and move the
    one builder/quant_choice.py chooses into `out`; fp32 stays as `reference` beside a quantized choice.
    Returns (the record: every candidate's numbers and the reason; the chosen engine's consistency record and
    rows per call, as measure_target_min_rows gives them)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from specpipe.builder import quant_choice
    from specpipe.contract.quant import AUTO_QUANT_CANDIDATES
    from specpipe.quantize.graph import folder_bytes
    from specpipe.quantize.pipeline import judge_quantized, quantize_weights

    folders, blocks, seconds = {"none": reference}, {}, {"none": 0.0}
    configs = {mode: qcfg.model_copy(update={"mode": mode, "accept_accuracy_loss": True}) for mode in AUTO_QUANT_CANDIDATES}
    folders.update({mode: out.with_name(f"{role}-{mode}") for mode in AUTO_QUANT_CANDIDATES})
    # specpipe's own quantizer runs in this process: one at a time. The model builder's run in processes of their own.
    side_by_side = 1 if checkpoint is None else quantizers_side_by_side(
        len(AUTO_QUANT_CANDIDATES), folder_bytes(reference), usable_cpus(), available_memory_bytes())
    say(f"--quant auto: quantizing the {role} as {', '.join(AUTO_QUANT_CANDIDATES)}"
        f"{' side by side' if side_by_side > 1 else ''}, and measuring each one's accuracy")
    started, cancel = time.perf_counter(), threading.Event()
    with ThreadPoolExecutor(max_workers=side_by_side, thread_name_prefix="specpipe-quantize") as pool:
        made = {pool.submit(quantize_weights, reference, folders[mode], configs[mode], tokenizer, checkpoint=checkpoint,
                            cancel=cancel): mode for mode in AUTO_QUANT_CANDIDATES}
        try:
            for future in as_completed(made):  # each judged as soon as it is made
                mode = made[future]
                result = future.result()
                say(f"--quant auto: measuring the accuracy of the {role} at {mode}")
                blocks[mode] = judge_quantized(reference, folders[mode], result, configs[mode], tokenizer,
                                               model_name=role, threads=cfg.backend.threads)
                seconds[mode] = round(time.perf_counter() - started, 2)  # since the quantizers started: they overlap
        except BaseException:  # the build fails now, not once the other builders have finished
            cancel.set()
            for future in made:
                future.cancel()
            raise
    consistency = {mode: measure_target_min_rows(folder, mode, cfg, tokenizer, say, timings) for mode, folder in folders.items()}
    rows = cfg.backend.max_batch_size
    say(f"--quant auto: timing {', '.join(map(quant_choice.name, folders))} at 1 to {rows} rows, in turn")
    decode_ms = measure_precisions(folders, {mode: c[1] for mode, c in consistency.items()}, rows, cfg.backend.threads)
    candidates = [QuantCandidate(mode=mode, accuracy=blocks[mode]["accuracy"] if mode in blocks else None,
                                 violations=blocks[mode]["violations"] if mode in blocks else [],
                                 within_budget=not (mode in blocks and blocks[mode]["violations"]), seconds=seconds[mode],
                                 decode_ms=decode_ms[mode], min_rows_per_call=consistency[mode][1])
                  for mode in folders]  # fmt: skip
    for candidate in candidates:
        say(f"--quant auto: {candidate.summary(rows)}")
    chosen, reason = quant_choice.choose(candidates, rows)
    say(f"--quant auto: chose {quant_choice.name(chosen)}: {reason}")
    for mode, folder in folders.items():
        if mode not in (chosen, "none"):
            shutil.rmtree(folder)
    folders[chosen].rename(out)
    if chosen == "none":
        record = QuantRecord(mode="none", budget=qcfg.budget, candidates=candidates, load_rows=rows, reason=reason)
    else:
        record = QuantRecord(**blocks[chosen], reference_path=reference.name, candidates=candidates, load_rows=rows,
                             reason=reason)
    return record, *consistency[chosen]


# Architectures onnxruntime-genai's builder turns into the shared-KV graph that engines/shared_kv.py runs.
GENAI_MODEL_TYPES = ("llama", "mistral", "qwen2", "phi3", "gemma")
GENAI_QUANT_MODES = ("none", "int4-wo", "int8-wo", "auto")
GENAI_HEAD_DIM_MULTIPLE = 16  # ONNX Runtime's CPU GroupQueryAttention refuses other head sizes


def builder_refusal(info, quant_mode: str) -> Optional[str]:
    """Why the builder's shared-KV graph cannot take this checkpoint at this quantization; None when it can."""
    if quant_mode not in GENAI_QUANT_MODES:
        return f"quant {quant_mode}; the builder's graph takes {'/'.join(GENAI_QUANT_MODES)}"
    if info.model_type not in GENAI_MODEL_TYPES:
        return f"a {info.model_type} model; the builder's graph takes {'/'.join(GENAI_MODEL_TYPES)}"
    if info.head_dim % GENAI_HEAD_DIM_MULTIPLE:
        return f"head_dim {info.head_dim}; GroupQueryAttention on CPU takes multiples of {GENAI_HEAD_DIM_MULTIPLE}"
    return None


def target_graph(cfg: BuildConfig, info) -> str:
    """Which exporter makes the target: "genai" (batches requests, engines/shared_kv.py) or "optimum".
    Weight-only quantization (MatMulNBits) works on either graph: the model builder quantizes its own
    (quantize/weight_only.py BUILDER_RECIPES), specpipe quantizes optimum's; calibrated modes (int8, fp8) and
    self-drafts are built for optimum's graph."""
    self_draft = any(spec.startswith("self:") for spec in cfg.draft)
    refusal = builder_refusal(info, cfg.quant.mode) or ("a self: draft" if self_draft else None)
    if cfg.backend.target_graph == "optimum" or (cfg.backend.target_graph == "auto" and refusal):
        return "optimum"
    if refusal:
        raise UsageError(f"--target-graph genai takes a {'/'.join(GENAI_MODEL_TYPES)} target, --quant "
                         f"{'/'.join(GENAI_QUANT_MODES)} and no self: draft (this one: {refusal})")
    if importlib.util.find_spec("onnxruntime_genai") is None:
        if cfg.backend.target_graph == "genai":
            raise UsageError("--target-graph genai needs onnxruntime-genai (pip install onnxruntime-genai)")
        return "optimum"
    return "genai"


def draft_graph(cfg: BuildConfig, info, target_graph_built: str) -> tuple[str, Optional[str]]:
    """Which exporter makes a model draft: the builder ("genai", a shared-KV engine whose one-token steps batch
    across requests: ModelDrafter.propose_batch) when the target was built with it and the draft can be, else
    "optimum". Returns (graph, why a genai target's draft stays on optimum, or None)."""
    if target_graph_built != "genai":
        return "optimum", None
    refusal = builder_refusal(info, cfg.draft_quant.mode)
    return ("optimum", f"draft {refusal}") if refusal else ("genai", None)


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
