"""`specpipe distill --kind eagle3`: target answers with features (cached) -> EAGLE-3 head -> upstream's head format.

The same teacher pass as the model draft (distill/run.py) also keeps the target's residual stream after the
feature layers, so the head trains without running the target again. The head is written as upstream's EAGLE-3
checkpoint (checkpoint/eagle3.py): config.json + model.safetensors, no tokenizer, plus distill.json (how it was made).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from specpipe.distill.config import DistillConfig
from specpipe.distill.progress import DistillProgress
from specpipe.errors import UsageError

HELD_OUT_SHARE = 0.15  # of prompts: every answer to a held-out prompt stays out of training
HELD_OUT_MAX = 48  # answers the held-out agreement is measured on


def prompt_key(seq) -> str:
    return hashlib.sha256(seq.token_ids[: seq.prompt_len].numpy().tobytes()).hexdigest()


def split_by_prompt(sequences: list, share: float = HELD_OUT_SHARE) -> tuple[list, list]:
    """(train, held out): a prompt is held out when its hash says so, with all of its answers (greedy and sampled)."""
    held = [s for s in sequences if s.prompt_len and int(prompt_key(s)[:8], 16) % 1000 < share * 1000]
    held_ids = {id(s) for s in held}
    return [s for s in sequences if id(s) not in held_ids] or sequences, held[:HELD_OUT_MAX]


def distill_eagle3(cfg: DistillConfig, progress: DistillProgress):
    import torch

    from specpipe.checkpoint.draft_vocab import count_tokens, top_token_ids
    from specpipe.distill.acceptance import head_chain_hits_alone_and_with_lookup
    from specpipe.distill.eagle3 import head_vocab_size, load_head_weights, make_head
    from specpipe.distill.eagle3_train import HeadTrainer
    from specpipe.distill.run import (STATE_DIR, DistillResult, _eos_ids, _teacher_data, open_target, split_record,
                                      train_phase)
    from specpipe.distill.verdict import ExportedTargets
    from specpipe.export.features import check_layers, default_layers
    from specpipe.machine import describe_machine
    from specpipe.speculative.eagle3 import LOOKUP_BELOW

    started = time.perf_counter()
    if cfg.data != ["answers"]:
        raise UsageError("--kind eagle3 trains on the target's answers only (--data answers): features come from them")
    out, device, target, tokenizer, model = open_target(cfg)
    num_layers = model.config.num_hidden_layers
    try:
        layers = check_layers(cfg.feature_layers, num_layers) if cfg.feature_layers else default_layers(num_layers)
    except ValueError as err:
        raise UsageError(f"--feature-layers: {err}") from None
    eos_ids = _eos_ids(target.path, tokenizer)
    # --init-head keeps that head's draft vocabulary (sized here, before the teacher pass; its ids loaded below)
    vocab_size = head_vocab_size(cfg.init_head, layers) if cfg.init_head is not None else cfg.head_vocab

    # the target as build exports it (with the feature outputs), once per precision: an ONNX teacher answers on one,
    # the verdict times them all (a temporary folder, removed at the end; if the run dies, when the process exits)
    targets = ExportedTargets(target.path, layers)
    precision: dict = {}
    answered: dict = {}
    sequences = _teacher_data(cfg, target, model, tokenizer, eos_ids, progress, device, precision, feature_layers=layers,
                              targets=targets, started=started, answered=answered)
    train_set, held_out = split_by_prompt(sequences)
    counts = count_tokens(train_set, model.config.vocab_size)
    vocab_ids = top_token_ids(counts, vocab_size, always=eos_ids)
    head = make_head(model, feature_layers=layers, draft_token_ids=torch.as_tensor(vocab_ids), warm_start=cfg.warm_start,
                     warm_attention=cfg.starts_attention_warm, seed=cfg.seed)
    if cfg.init_head is not None:  # train further: its weights and its draft vocabulary, not this data's
        load_head_weights(head, cfg.init_head)
        vocab_ids = head.draft_to_target(torch.arange(head.shape.draft_vocab_size)).numpy()
    head = head.to(device)

    state_path = out / STATE_DIR / "state.pt"
    if cfg.force and out.is_dir() and not cfg.resume:
        shutil.rmtree(out)
    trainer = HeadTrainer(head, train_set, steps=cfg.ttt_steps, decay=cfg.ttt_decay,
                          budget_s=cfg.train_budget_s(time.perf_counter() - started), lr=cfg.lr,
                          batch_tokens=cfg.batch_tokens, negatives=cfg.negatives, prompt_weight=cfg.prompt_weight,
                          seed=cfg.seed, state_path=state_path, checkpoint_every=cfg.checkpoint_every,
                          budget_tokens=cfg.train_tokens, held_out=held_out)
    state = train_phase(cfg, device, trainer, precision, started, progress, "EAGLE-3 head")

    best = trainer.best
    parameters = sum(p.numel() for p in head.parameters())
    chain_alone, chain_looked = head_chain_hits_alone_and_with_lookup(head, held_out, LOOKUP_BELOW)
    record = {
        "format": 1,
        "kind": "eagle3",
        "target": {"source": cfg.target, "path": str(target.path), "weights_sha256": target.weights_sha256},
        "config": json.loads(cfg.model_dump_json()),
        "draft": {"layers": 1, "width": head.shape.hidden_size, "parameters": parameters,
                  "feature_layers": list(layers), "draft_vocab_size": len(vocab_ids),
                  "draft_vocab_coverage": round(float(counts[vocab_ids].sum() / max(1, counts.sum())), 5),
                  # weights read per drafted token against the target's (a tied embedding counted once)
                  "weights_read_per_token_vs_target": round(parameters / sum(p.numel() for p in model.parameters()), 4)},
        "data": {"sequences": len(train_set), "held_out": len(held_out), "held_out_prompts": "split by prompt",
                 "tokens": sum(len(s) for s in train_set),
                 "answer_tokens": sum(len(s) - s.prompt_len for s in train_set if s.prompt_len),
                 "answer_batch": answered.get("rows")},  # prompts the teacher answered at once
        "training": {"steps": state.step, "seconds": round(state.elapsed_s, 1), "tokens_seen": state.tokens_seen,
                     "epochs": round(state.tokens_seen / max(1, sum(len(s) for s in train_set)), 2),
                     "ttt_steps": cfg.ttt_steps, "ttt_decay": cfg.ttt_decay, "warm_start": cfg.warm_start,
                     "warm_attention": cfg.starts_attention_warm,
                     "init_head": str(cfg.init_head) if cfg.init_head else None,
                     "final_loss": round(state.recent_loss, 4), "history": state.history},
        "split": split_record(cfg, answered, train_set, state, progress),
        # Step-0 agreement with the target's greedy token on held-out prompts, of the weights kept (the best seen).
        "held_out_agreement": best[0] if best else None,
        "held_out_agreement_by_step": next((e[4] for e in state.evals if best and e[0] == best[1]), None),
        # The kept weights drafting chains on the held-out answers: per-position acceptance given the earlier
        # positions accepted, and accepted tokens per verify at K=3 (distill/acceptance.py states the conventions).
        "held_out_chain": chain_alone.summary() if held_out else None,
        # ... and as the decoder drafts with it: prompt lookup where the head is unsure (speculative/eagle3.py)
        "held_out_chain_with_lookup": chain_looked.summary() if held_out else None,
        "kept_step": best[1] if best else state.step,
        "held_out_curve": state.evals,
        "device": str(device),
        "machine": describe_machine(cfg.threads).as_dict(),
        "precision": {phase: c.as_dict() for phase, c in precision.items()},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    head.to("cpu")
    chain = record["held_out_chain_with_lookup"]  # what decoding will see
    acceptance = chain["conditional"][0] if chain and chain["anchors"] else record["held_out_agreement"]

    def judge(folder: Path) -> None:  # the written head timed as its CPU engine, the target as its ONNX engine
        from specpipe.distill.teacher import prompts_of
        from specpipe.distill.verdict import measured_verdict, no_prediction, verdict_line

        if cfg.verdict:
            progress.log("timing the target (ONNX Runtime) and the head (its CPU engine) for the verdict")
            timed = measured_verdict(acceptance or 0.0, target.path, threads=cfg.threads, head=folder,
                                     feature_layers=layers, quants=cfg.verdict_quant, targets=targets,
                                     prompts=prompts_of(held_out), tokenizer=tokenizer, eos_token_ids=sorted(eos_ids))
        else:
            timed = no_prediction(acceptance or 0.0)
        record["verdict"] = {**timed,
                             "agreement_on": ("held-out answers, position 1, prompt lookup where the head is unsure"
                                              if chain else "no held-out answers")}
        progress.log(verdict_line(record["verdict"]))

    _write_head(head, out, record, before_move=judge)
    targets.close()
    shutil.rmtree(out / STATE_DIR, ignore_errors=True)
    return DistillResult(out, record)


def _write_head(head, out: Path, record: dict, before_move: Callable[[Path], None] = lambda folder: None) -> None:
    """Write into a temp folder beside OUT, then move the files in: OUT never holds half a head.
    `before_move(folder)` runs on the written head before its record is written (the verdict times it)."""
    from specpipe.checkpoint.eagle3 import head_config, write_eagle3_head
    from specpipe.distill.run import RECORD

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:
        write_eagle3_head(Path(tmp), head.state_dict(), head_config(head.shape))
        before_move(Path(tmp))
        (Path(tmp) / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        for item in Path(tmp).iterdir():
            os.replace(item, out / item.name)
