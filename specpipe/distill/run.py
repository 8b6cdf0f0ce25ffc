"""`specpipe distill`: target -> teacher data (cached) -> small draft -> trained draft as an HF checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from specpipe.contract.drafts import DISTILL_RECORD
from specpipe.distill.config import DistillConfig
from specpipe.distill.progress import DistillProgress, SilentProgress
from specpipe.errors import OutputExistsError, UsageError

STATE_DIR = ".distill"  # inside OUT while training: the resumable state; removed when the draft is written
RECORD = DISTILL_RECORD  # inside the finished OUT: how the draft was made and how well it agrees
HELD_OUT_MAX = 24  # answers kept out of training to measure agreement on unseen prompts
MIN_ANSWER_S = 1.0  # the least time the answers get when the phases before them took their whole share


@dataclass
class DistillResult:
    path: Path
    record: dict


def check_out_dir(cfg: DistillConfig) -> Path:
    """OUT must be writable, and empty unless --force or --resume. Checked before any expensive step."""
    out = Path(cfg.out).expanduser()
    state = out / STATE_DIR / "state.pt"
    if cfg.resume and not state.is_file():
        raise UsageError(f"--resume: {out} has no saved training state ({state.relative_to(out)})")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (cfg.force or cfg.resume):
        raise OutputExistsError(f"{out} exists and is not empty; pass --force to replace it or --resume to continue")
    parent = out if out.is_dir() else _nearest_existing_parent(out)
    try:  # a real probe: permission bits say little when running as root
        fd, probe = tempfile.mkstemp(prefix=".specpipe-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise UsageError(f"--out {out} is not writable ({parent}: {err.strerror or err})") from None
    return out


def _nearest_existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    if not path.is_dir():
        raise UsageError(f"--out is not writable: {path} is a file, so nothing can be created under it")
    return path


def _teacher_cache_key(cfg: DistillConfig, target, prompts: list[dict], source: str, teacher, device,
                       feature_layers: tuple[int, ...] = (), rows: Optional[int] = None) -> dict:
    """teacher: a teachers.Teacher (torch in a dtype, or the ONNX engine at a precision); rows: the prompts it answers
    at once (cfg.answer_batch when None): the batches' padding and sampling make them part of the data."""
    import hashlib

    prompts_hash = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]
    key = {"format": 1, "source": source, "target_weights": target.weights_sha256, "prompts": prompts_hash,
           "max_answer_tokens": cfg.max_answer_tokens, "top_k": cfg.teacher_top_k, **teacher.cache_key(),
           "sample_temperature": cfg.sample_temperature, "batch": rows or cfg.answer_batch, "seed": cfg.seed}
    if device.type != "cpu":  # kernels differ by device; CPU keys stay as they were (caches remain valid)
        key["device"] = device.type
    if feature_layers:  # answers with EAGLE-3 features are a cache of their own; plain caches keep their keys
        key["features"] = list(feature_layers)
    return key


def _read_prompts(path: Path) -> list[dict]:
    prompts = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise UsageError(f"--prompts {path}: {err.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            prompts.append({"kind": "custom", "prompt": str(json.loads(line)["prompt"])})
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"--prompts {path}:{number}: expected a JSON object with a \"prompt\" field") from None
    return prompts


def _answers_complete(cache, cfg: DistillConfig, budget_s: float) -> bool:
    """The cached answers cover the budget: the work budget's answer tokens, else the time budget."""
    return cache.answer_tokens >= cfg.answer_tokens if cfg.answer_tokens else cache.seconds >= budget_s


def _answer_rows(cfg: DistillConfig) -> list[int]:
    """The rows a teacher may answer at once, to choose from by measurement: torch and ONNX teachers alike."""
    return list(cfg.answer_batches or [cfg.answer_batch])


def _cached_teacher(cfg: DistillConfig, root: Path, target, prompts: list[dict], device, feature_layers: tuple[int, ...],
                    budget_s: float, candidates: list):
    """With more than one candidate teacher (--teacher-engine or --teacher-dtype auto) or rows: (the candidate, its
    rows) whose teacher data is already cached whole for these settings, or None. Measuring again could pick another
    candidate where two run about as fast (seen with AVX512-BF16), and the cache, keyed by the teacher and its rows,
    would then be made again (minutes of target answers)."""
    from specpipe.distill.precision import PrecisionChoice
    from specpipe.distill.teacher import TeacherCache

    if len(candidates) < 2 and len(_answer_rows(cfg)) < 2:
        return None
    for teacher in candidates:
        for rows in _answer_rows(cfg):
            complete = True
            if "answers" in cfg.data:
                cache = TeacherCache.existing(root, _teacher_cache_key(cfg, target, prompts, "answers", teacher, device,
                                                                       feature_layers, rows))
                complete = cache is not None and _answers_complete(cache, cfg, budget_s)
            if complete and "stdlib" in cfg.data:
                cache = TeacherCache.existing(root, _teacher_cache_key(cfg, target, [], "stdlib", teacher, device))
                complete = cache is not None and cache.seconds >= budget_s
            if complete:
                return PrecisionChoice("teacher", teacher.name, {}), rows
    return None


def _teacher_data(cfg: DistillConfig, target, model, tokenizer, eos_ids: set[int], progress: DistillProgress,
                  device, precision: dict, feature_layers: tuple[int, ...] = (), targets=None,
                  started: Optional[float] = None, answered: Optional[dict] = None):
    """Generate (or reuse) the target's answers and, if asked, labelled stdlib text. Returns sequences.
    Sets precision["teacher"] to the PrecisionChoice it used (its dtype: the teacher's name, teachers.Teacher).
    `feature_layers`: the answers also carry the target's residual stream after those layers (EAGLE-3 features,
    recorded in the same forward passes). `targets`: the run's exported targets (verdict.ExportedTargets), which an
    ONNX teacher answers on; made here for this call when not given. `started` (a time.perf_counter() value): when
    the run began; with a work budget the answers stop at their share of --minutes counted from it, so loading the
    target, exporting its engines and the teacher probe come out of that share, not on top of the cap. `answered`:
    given a dict, it receives the answers' cache's answer tokens and generation seconds (the teacher's rate)."""
    from specpipe.checkpoint import cache_dir
    from specpipe.distill.prompts import training_prompts
    from specpipe.distill.teacher import TeacherCache, chat_ids, generate_teacher_data, label_text, stdlib_windows
    from specpipe.distill.teachers import (PROBE_ROWS, Teacher, Teachers, choose_answer_rows, choose_teacher,
                                           teacher_candidates)
    from specpipe.distill.verdict import ExportedTargets

    budget_s = cfg.minutes * 60 * cfg.data_fraction / len(cfg.data)
    root = cache_dir() / "distill-data"
    sequences = []
    own_targets = targets is None
    targets = targets or ExportedTargets(target.path, feature_layers)
    teachers = Teachers(model, device, targets=targets, threads=cfg.threads, batch_rows=cfg.answer_batch,
                        top_k=cfg.teacher_top_k, feature_layers=feature_layers)
    prompts = (_read_prompts(cfg.prompts) if cfg.prompts else []) + training_prompts(cfg.seed)
    candidates = teacher_candidates(cfg.teacher_engine, cfg.teacher_dtype, device, cfg.verdict_quant, cfg.data)
    cached = _cached_teacher(cfg, root, target, prompts, device, feature_layers, budget_s, candidates)
    if cached is not None:
        choice, rows = cached
        progress.log(f"precision teacher: {choice.dtype}, {rows} prompts at once (the teacher data cached whole for "
                     "these settings was made by it; not measured again)")
    else:
        probe_ids = [tokenizer(p["prompt"])["input_ids"] for p in prompts[:PROBE_ROWS]]
        batch_ids = chat_ids(tokenizer, prompts[: cfg.answer_batch]) if "answers" in cfg.data else None
        choice = choose_teacher(candidates, device, lambda teacher: teachers.probe(teacher, probe_ids),
                                make_runoff=(lambda teacher: teachers.runoff(teacher, batch_ids)) if batch_ids else None)
        progress.log(f"precision {choice.describe()}")
    precision["teacher"] = choice
    teacher = Teacher.parse(choice.dtype)
    if cached is None:
        rows = cfg.answer_batch
        candidate_rows = _answer_rows(cfg)
        if "answers" in cfg.data and len(candidate_rows) > 1:
            rows_ids = chat_ids(tokenizer, prompts[: max(candidate_rows)])
            rows_choice = choose_answer_rows(candidate_rows, device, lambda r: teachers.rows_call(teacher, rows_ids[:r]),
                                             warm=bool(choice.tokens_per_s))
            precision["teacher rows"] = rows_choice
            rows = int(rows_choice.dtype)
            teachers.keep_rows(rows)
            progress.log(f"precision {rows_choice.describe()}")

    if "answers" in cfg.data:
        cache = TeacherCache.for_settings(root, _teacher_cache_key(cfg, target, prompts, "answers", teacher, device,
                                                                   feature_layers, rows))
        budget_tokens = cfg.answer_tokens
        if not _answers_complete(cache, cfg, budget_s):
            # With a work budget the bar counts answer tokens, so its ETA comes from the measured rate.
            total = budget_tokens or budget_s
            progress.phase("teacher", total, f"target answers ({teacher.name})")
            made = {"tokens": 0}

            def done_so_far() -> float:
                return min(cache.answer_tokens if budget_tokens else cache.seconds, total)

            def on_batch(tokens: int, seconds: float) -> None:
                made["tokens"] += tokens
                progress.update(done_so_far(), answers=cache.answered, tokens=made["tokens"],
                                tok_s=tokens / seconds if seconds else 0.0)

            progress.update(done_so_far(), answers=cache.answered)
            answer_s = budget_s
            if budget_tokens and started is not None:  # at least a moment: a batch cut short keeps its answers
                answer_s = max(MIN_ANSWER_S, started + budget_s - time.perf_counter())
            generate_teacher_data(
                teachers.answerer(teacher, rows), tokenizer, cache, prompts, budget_s=answer_s, budget_tokens=budget_tokens,
                batch_size=rows, max_new_tokens=cfg.max_answer_tokens, eos_token_ids=eos_ids,
                top_k=cfg.teacher_top_k, sample_temperature=cfg.sample_temperature, seed=cfg.seed, on_batch=on_batch,
                feature_layers=feature_layers,
            )
            if budget_tokens and cache.answer_tokens < budget_tokens:
                progress.log(f"time cap (--minutes) reached at {cache.answer_tokens:,} of {budget_tokens:,} answer "
                             "tokens: this draft's data differs from a run that finishes the budget")
        else:
            progress.log(f"reusing {cache.answered} cached target answers ({cache.answer_tokens:,} tokens, "
                         f"{cache.seconds:.0f} s of generation)")
        sequences += cache.load(max_answer_tokens=budget_tokens)
        if answered is not None:
            answered.update(answer_tokens=cache.answer_tokens, seconds=cache.seconds, rows=rows)

    if "stdlib" in cfg.data:  # torch only (teacher_candidates)
        teacher_model = lambda: teachers.torch_model(teacher.precision)  # noqa: E731
        cache = TeacherCache.for_settings(root, _teacher_cache_key(cfg, target, [], "stdlib", teacher, device))
        if cache.seconds < budget_s:
            progress.phase("stdlib", budget_s, "stdlib labels")
            for window in stdlib_windows(tokenizer, window=256, seed=cfg.seed + cache.answered):
                t0 = time.perf_counter()
                cache.append([label_text(teacher_model(), window, top_k=cfg.teacher_top_k, kind="stdlib")],
                             time.perf_counter() - t0, 1)
                progress.update(min(cache.seconds, budget_s), windows=cache.answered)
                if cache.seconds >= budget_s:
                    break
        sequences += cache.load()
    teachers.release()
    if own_targets:
        targets.close()
    return sequences


def train_phase(cfg: DistillConfig, device, trainer, precision: dict, started: float, progress: DistillProgress,
                what: str):
    """The training both kinds share: the trainer's dtype (cfg.train_dtype, or measured with its probe; fp16 would need
    loss scaling, so the candidates are fp32 and bf16 on any device), recorded in `precision`; the saved state on
    --resume; the time budget from the clock as it stands (after the probe: a cap counts it too); the run, with
    progress on `what`; the state saved. Returns the final training state."""
    from specpipe.distill.precision import choose_precision

    choice = choose_precision("train", cfg.train_dtype, device, trainer.probe, options=["float32", "bfloat16"])
    precision["train"] = choice
    trainer.dtype = choice.dtype
    progress.log(f"precision {choice.describe()}")
    if cfg.resume:
        trainer.load()
    trainer.budget_s = cfg.train_budget_s(time.perf_counter() - started, trainer.state.elapsed_s)
    if cfg.resume:
        progress.log(f"resumed at step {trainer.state.step} ({trainer.state.elapsed_s:.0f} s of {trainer.budget_s:.0f} s)")
    total = cfg.train_tokens or trainer.budget_s
    progress.phase("train", total, f"training {what} ({choice.dtype})")
    state = trainer.run(on_step=lambda r: progress.update(
        min(r.tokens_seen if cfg.train_tokens else r.elapsed_s, total), loss=r.loss, agree=r.agreement,
        tok_s=r.tokens_per_s))
    trainer.save()
    if cfg.train_tokens and state.tokens_seen < cfg.train_tokens:
        progress.log(f"time cap (--minutes) reached at {state.tokens_seen:,} of {cfg.train_tokens:,} training tokens")
    return state


def split_record(cfg: DistillConfig, answered: dict, train_set: list, state, progress: DistillProgress) -> Optional[dict]:
    """How the run's time budget split between answers and training, measured (distill/split.py), with a line of
    advice when its --data-fraction was off the share its rates say (for heads: the epochs it aims at were measured
    on heads); None under a work budget (--answer-tokens or --train-tokens: the fraction is only a cap there) or with
    more than one --data source."""
    from specpipe.distill.split import measured_split

    if cfg.answer_tokens or cfg.train_tokens or cfg.data != ["answers"]:
        return None
    split = measured_split(cfg.data_fraction, answered.get("answer_tokens", 0), answered.get("seconds", 0.0),
                           sum(len(s) for s in train_set), state.tokens_seen, state.elapsed_s)
    if split is None:
        return None
    advice = split.advice() if cfg.kind == "eagle3" else None
    if advice:
        progress.log(advice)
    return {**split.as_dict(), "answer_tokens": answered["answer_tokens"], "answer_s": round(answered["seconds"], 1),
            "advice": advice}


def open_target(cfg: DistillConfig):
    """What both kinds start from: OUT checked, the device and threads set, the target resolved and loaded.
    Returns (out, device, target, tokenizer, model)."""
    import torch

    from specpipe.checkpoint import load_causal_lm, load_tokenizer, resolve_checkpoint
    from specpipe.checkpoint.load import require_causal_lm
    from specpipe.distill.precision import resolve_device

    out = check_out_dir(cfg)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device here (use --device auto or cpu)")
    device = resolve_device(cfg.device)
    torch.set_num_threads(cfg.threads)
    target = resolve_checkpoint(cfg.target)
    require_causal_lm(target.path)
    tokenizer = load_tokenizer(target.path)
    return out, device, target, tokenizer, load_causal_lm(target.path)


def distill_model(cfg: DistillConfig, progress: Optional[DistillProgress] = None) -> DistillResult:
    """--kind model: train a draft for cfg.target and write it to cfg.out as an HF checkpoint (safetensors, tokenizer,
    config)."""
    from specpipe.distill.student import draft_cost_ratio, make_student
    from specpipe.distill.train import Trainer

    from specpipe.distill.teacher import prompts_of
    from specpipe.distill.verdict import ExportedTargets, measured_verdict, no_prediction, verdict_line
    from specpipe.machine import describe_machine

    progress = progress or SilentProgress()
    started = time.perf_counter()
    out, device, target, tokenizer, model = open_target(cfg)
    eos_ids = _eos_ids(target.path, tokenizer)
    # the target as build exports it, once per precision: an ONNX teacher answers on one, the verdict times them all
    # (a temporary folder, removed at the end; if the run dies, when the process exits)
    targets = ExportedTargets(target.path)

    precision: dict = {}
    answered: dict = {}
    sequences = _teacher_data(cfg, target, model, tokenizer, eos_ids, progress, device, precision, targets=targets,
                              started=started, answered=answered)
    held_out = [s for i, s in enumerate(sequences) if s.prompt_len and i % 20 == 19][:HELD_OUT_MAX]
    held_ids = {id(s) for s in held_out}
    train_set = [s for s in sequences if id(s) not in held_ids] or sequences

    # The projection basis comes from the target's residual stream on a few of its own answers.
    samples = [s.token_ids for s in train_set[:16]]
    student = make_student(model, layers=cfg.layers, width=cfg.width, seed=cfg.seed, samples=samples).to(device)
    state_path = out / STATE_DIR / "state.pt"
    if cfg.force and out.is_dir() and not cfg.resume:
        shutil.rmtree(out)
    trainer = Trainer(student, train_set, budget_s=cfg.train_budget_s(time.perf_counter() - started), lr=cfg.lr,
                      batch_tokens=cfg.batch_tokens, negatives=cfg.negatives, prompt_weight=cfg.prompt_weight,
                      seed=cfg.seed, state_path=state_path, checkpoint_every=cfg.checkpoint_every,
                      budget_tokens=cfg.train_tokens, held_out=held_out)
    state = train_phase(cfg, device, trainer, precision, started, progress, "draft")

    best = trainer.best
    record = {
        "format": 1,
        "target": {"source": cfg.target, "path": str(target.path), "weights_sha256": target.weights_sha256},
        "config": json.loads(cfg.model_dump_json()),
        "draft": {"layers": cfg.layers, "width": student.config.hidden_size,
                  "parameters": sum(p.numel() for p in student.parameters()),
                  "weights_read_per_token_vs_target": round(draft_cost_ratio(student.config, model.config), 4)},
        "data": {"sequences": len(train_set), "held_out": len(held_out),
                 "tokens": sum(len(s) for s in train_set),
                 "answer_tokens": sum(len(s) - s.prompt_len for s in train_set if s.prompt_len),
                 "answer_batch": answered.get("rows"),  # prompts the teacher answered at once
                 "kinds": sorted({s.kind for s in sequences})},
        "training": {"steps": state.step, "seconds": round(state.elapsed_s, 1), "tokens_seen": state.tokens_seen,
                     "epochs": round(state.tokens_seen / max(1, sum(len(s) for s in train_set)), 2),
                     "final_loss": round(state.recent_loss, 4), "history": state.history},
        "split": split_record(cfg, answered, train_set, state, progress),
        # Agreement with the target's greedy answers to held-out prompts, of the weights kept (the best
        # seen on those answers during training, so slightly optimistic).
        "held_out_agreement": best[0] if best else None,
        "kept_step": best[1] if best else state.step,
        "held_out_curve": state.evals,
        "device": str(device),
        "machine": describe_machine(cfg.threads).as_dict(),  # where the precision timings and rates come from
        "precision": {phase: choice.as_dict() for phase, choice in precision.items()},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    student.eval()
    # Too few answers for a held-out set (a tiny budget): the training agreement stands in, and says so.
    measured_on = "held-out answers" if best else "training batches (no held-out answers)"
    acceptance = best[0] if best else (state.recent_agreement if state.recent_agreement == state.recent_agreement else 0.0)
    model.to("cpu")
    student.to("cpu")
    from specpipe.checkpoint.draft_vocab import count_tokens

    def judge(folder: Path) -> None:  # the written draft, exported and timed as an engine beside the target
        if cfg.verdict:
            progress.log("timing the target and the draft as ONNX Runtime engines for the verdict")
            timed = measured_verdict(acceptance, target.path, threads=cfg.threads, draft=folder,
                                     quants=cfg.verdict_quant, targets=targets, prompts=prompts_of(held_out),
                                     tokenizer=tokenizer, eos_token_ids=sorted(eos_ids))
        else:
            timed = no_prediction(acceptance)
        record["verdict"] = {**timed, "agreement_on": measured_on}
        progress.log(verdict_line(record["verdict"]))

    counts = count_tokens(sequences, model.config.vocab_size)  # what the draft learned to predict
    _write_checkpoint(student, tokenizer, target.path, out, record, counts, before_move=judge)
    targets.close()
    shutil.rmtree(out / STATE_DIR, ignore_errors=True)
    return DistillResult(out, record)


def _eos_ids(path: Path, tokenizer) -> set[int]:
    ids = set()
    gen_cfg = Path(path) / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return {int(i) for i in ids}


def _write_checkpoint(student, tokenizer, target_path: Path, out: Path, record: dict, counts,
                      before_move: Callable[[Path], None] = lambda folder: None) -> None:
    """save_pretrained into a temp folder beside OUT, then move the files in: OUT never holds half a model.
    `before_move(folder)` runs on the written checkpoint before its record is written (the verdict times it).

    Beside the weights: the ranking of the tokens the draft was trained on (`build` slices the draft's
    head to the most frequent ones, see checkpoint/draft_vocab.py)."""
    from specpipe.checkpoint.draft_vocab import write_ranking

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:
        student.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_ranking(Path(tmp), counts, source="specpipe distill: target answers" + (
            " and stdlib text" if "stdlib" in record["config"]["data"] else ""))
        generation_config = Path(target_path) / "generation_config.json"
        if generation_config.is_file():
            shutil.copy2(generation_config, Path(tmp) / "generation_config.json")
        before_move(Path(tmp))
        (Path(tmp) / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        for item in Path(tmp).iterdir():
            os.replace(item, out / item.name)
