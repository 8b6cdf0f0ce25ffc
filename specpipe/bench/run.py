"""`specpipe bench`: one deployment, its prompt sets, every row, one run -> a results dict (the --json output)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable, Optional

from specpipe.bench.config import BenchConfig
from specpipe.bench.harness import BASELINE, PADDED_BASELINE, measurement_dict, run_rows, spec_rows, summarize
from specpipe.bench.limits import floor_ms, paired_floor, weight_bytes
from specpipe.bench.peers.common import PRECISION_OF_QUANT
from specpipe.bench.peers.compare import add_vs_specpipe, check_against_own, own_baseline_label, peer_best
from specpipe.bench.prompts import load_prompt_sets
from specpipe.engines.timing import batch_step_ms, step_ms
from specpipe.errors import UsageError
from specpipe.speculative.ngram import copy_ceiling

Progress = Callable[[str, int, int], None]  # (what, done, total)
# The deployment's draft kind (manifest "draft.kind") -> what its speculative rows draft with.
STRATEGY_OF_DRAFT = {"model": "draft-model", "ngram": "prompt-lookup", "self": "self-draft", "eagle3": "eagle3-head"}


def run_bench(cfg: BenchConfig, progress: Optional[Progress] = None) -> dict:
    import torch

    from specpipe.contract.manifest import now_iso
    from specpipe.deployment import load_deployment
    from specpipe.machine import describe_machine, library_versions

    say = progress or (lambda what, done, total: None)
    if not (Path(cfg.engine_dir) / "manifest.json").is_file():
        raise UsageError(f"{cfg.engine_dir} is not a built deployment (no manifest.json); run `specpipe build` first")
    prompt_sets = load_prompt_sets(cfg.prompts, list(cfg.prompt_sets), cfg.max_prompts)
    torch.set_num_threads(cfg.threads)
    deployment = load_deployment(cfg.engine_dir, threads=cfg.threads, head=cfg.head)
    too_long = [k for k in cfg.draft_lengths if k > deployment.max_draft_len]
    if too_long:
        raise UsageError(f"-k {too_long}: this deployment was built for K <= {deployment.max_draft_len}")

    generator = deployment.generator
    strategy = STRATEGY_OF_DRAFT.get("eagle3" if cfg.head else deployment.manifest.draft.kind, "draft-model")
    rows = spec_rows(generator, cfg.draft_lengths if deployment.drafter is not None else [],
                     cfg.adaptive and deployment.drafter is not None, decoding=deployment.decoding,
                     strategy=strategy, alone=deployment.target_alone(cfg.threads))
    from specpipe.bench.peers import peer_accuracy, peer_rows, peer_versions

    head_dir, head_layers = _head(deployment)
    extra, peer_notes = peer_rows(list(cfg.peers), deployment.manifest.as_dict(), cfg.threads,
                                  cfg.peer_draft_lengths or cfg.draft_lengths,
                                  say=lambda text: say(text, 0, None), head_dir=head_dir, head_layers=head_layers)
    rows += extra
    accuracy, accuracy_notes = peer_accuracy(list(cfg.peers), deployment.manifest.as_dict(), cfg.threads,
                                             deployment.tokenizer, say=lambda text: say(text, 0, None))
    peer_notes += accuracy_notes

    encoded = [(s.name, [(p.id, generator.encode(p.prompt, chat=cfg.chat)) for p in s.prompts]) for s in prompt_sets]
    total = sum(len(rows) * len(prompts) * cfg.rounds for _, prompts in encoded) + len(rows) * cfg.warmup_prompts
    done = 0

    def on_run(label: str, prompt_id: str) -> None:
        nonlocal done
        done += 1
        say(f"{label} · {prompt_id}", done, total)

    precision = PRECISION_OF_QUANT.get(deployment.manifest.target.engine.quant)
    started = time.perf_counter()
    warmup = [encoded[0][1][i % len(encoded[0][1])][1] for i in range(cfg.warmup_prompts)]
    sets = []
    for index, (name, prompts) in enumerate(encoded):
        results = run_rows(rows, prompts, max_new_tokens=cfg.max_new_tokens, warmup=warmup if index == 0 else [],
                           on_run=on_run, rounds=cfg.rounds)
        table = _table(rows, results, precision)
        baseline = results[BASELINE]
        sets.append({
            "name": name,
            "prompts": len(prompts),
            "rows": table,
            "best": _best(table),
            "peer_best": peer_best(table),
            "copy_ceiling": _copy_ceiling(prompts, baseline),
            "per_prompt": {label: [measurement_dict(m) for m in runs] for label, runs in results.items()},
        })

    say("measuring memory bandwidth and engine step costs", done, total)
    return {
        "engine_dir": str(cfg.engine_dir),
        "created": now_iso(),
        "settings": cfg.model_dump(mode="json"),
        "versions": library_versions(),
        "machine": describe_machine(threads=cfg.threads).as_dict(),  # absolute times hold only on this machine
        "physical_limit": _physical_limit(deployment, sets),
        "step_costs_ms": _step_costs(deployment),
        "adaptive_costs": deployment.costs.as_dict(),  # what adaptive K assumed: the build's measurement
        "peer_notes": peer_notes,
        "peer_accuracy": accuracy,  # at int8 / int4: each quantized target against its own fp32 (bench/peers)
        "peer_versions": peer_versions(list(cfg.peers)),
        "sets": sets,
        "wall_s": time.perf_counter() - started,
    }


def _head(deployment) -> tuple[Optional[Path], tuple[int, ...]]:
    """The EAGLE-3 head drafting in this bench (`--draft HEAD`, else the deployment's) and the target layers it reads,
    for the peers that run heads; (None, ()) when the draft is no head."""
    head = getattr(deployment.drafter, "head", None)
    if head is None:
        return None, ()
    return Path(head.folder), tuple(head.feature_layers)


def _table(rows: list, results: dict, own_precision: Optional[str]) -> list[dict]:
    """Every row summarized against specpipe's target-only; a peer row also against its own target-only,
    and beside specpipe's row of the same strategy and K (specpipe.bench.peers.compare)."""
    table = []
    for row in rows:
        peer = getattr(row, "peer", None)
        reference = results.get(PADDED_BASELINE) if row.kind == "speculative" and peer is None else None
        summary = summarize(row.label, row.kind, row.k, results[row.label], results[BASELINE], reference)
        summary.update(peer=peer, strategy=getattr(row, "strategy", "target-only"),
                       precision=getattr(row, "precision", own_precision), settings=getattr(row, "settings", None) or None)
        if peer is not None:  # matches_target becomes "vs its own target-only"; keep the cross-engine count too
            summary["matches_specpipe_target"] = summary["matches_target"]
            check_against_own(summary, results[row.label], results.get(own_baseline_label(peer)))
        table.append(summary)
    return add_vs_specpipe(table)


def _best(table: list[dict]) -> Optional[dict]:
    """specpipe's fixed-K row with the highest speedup."""
    fixed = [row for row in table if row["kind"] == "speculative" and row["k"] is not None and row["speedup"]
             and row.get("peer") is None]
    if not fixed:
        return None
    row = max(fixed, key=lambda r: r["speedup"])
    return {"k": row["k"], "speedup": row["speedup"], "acceptance_rate": row["acceptance_rate"]}


def _copy_ceiling(prompts: list, baseline: list) -> dict:
    """Tokens per target call the best possible prompt-lookup drafter could reach on the target's own answers
    (speculative/ngram.py `copy_ceiling`): with free verification, an upper bound on any copying drafter's speedup."""
    per_prompt = [copy_ceiling(ids, run.token_ids) for (_, ids), run in zip(prompts, baseline)]
    return {"tokens_per_call_median": statistics.median(per_prompt) if per_prompt else None, "per_prompt": per_prompt}


def _physical_limit(deployment, sets: list[dict]) -> dict:
    """Bytes of target weights per token / measured bandwidth (limits.py), beside the target's decode: its engine
    step timed in turns with the bandwidth (each judged against its own round's floor), and the generation's
    target-only ms/token (the engine plus specpipe's loop) against the floor at the rounds' median bandwidth."""
    target_dir = deployment.folder / deployment.manifest.target.engine.path
    target_bytes = weight_bytes(target_dir)
    paired = paired_floor(lambda: step_ms(deployment.target, 1, repeats=10), target_bytes)
    measured = [row["ms_per_token"] for s in sets for row in s["rows"] if row["label"] == BASELINE and row["ms_per_token"]]
    floor = paired["floor_ms_per_token"]
    out = {
        "bandwidth_gb_s": paired["bandwidth_gb_s"],
        "bandwidth_gb_s_range": [paired["bandwidth_gb_s_min"], paired["bandwidth_gb_s_max"]],
        "target_weight_bytes": target_bytes,
        "target_floor_ms_per_token": floor,
        "target_measured_ms_per_token": min(measured) if measured else None,
        "target_step_vs_floor": paired["step_vs_floor"],
        "target_step_vs_floor_range": [paired["step_vs_floor_min"], paired["step_vs_floor_max"]],
        "rounds": paired["rounds"],
    }
    out["target_measured_vs_floor"] = out["target_measured_ms_per_token"] / floor if measured and floor else None
    draft = deployment.manifest.draft
    if draft.kind == "model":
        draft_bytes = weight_bytes(deployment.folder / draft.engine.path)
        out["draft_weight_bytes"] = draft_bytes
        out["draft_floor_ms_per_token"] = floor_ms(draft_bytes, paired["bandwidth_gb_s"] * 1e9)
    return out


def _step_costs(deployment) -> dict:
    """Engine calls timed alone: a target decode step, a K=4 verify, a draft decode step, 16 requests' decode
    steps in one batched call (64-token cache)."""
    out = {"target_decode": step_ms(deployment.target, 1), "target_verify_k4": step_ms(deployment.target, 5)}
    engine = getattr(deployment.drafter, "engine", None)
    if engine is not None:
        out["draft_decode"] = step_ms(engine, 1)
        out["draft_vs_target"] = out["draft_decode"] / out["target_decode"]
    out["verify_k4_vs_decode"] = out["target_verify_k4"] / out["target_decode"]
    # One-token steps of 16 requests in one call (continuous batching; an engine without batched calls runs them
    # one by one): what serving many users costs per step.
    out["target_batch16_decode"] = batch_step_ms(deployment.target, 16, repeats=3)
    return out
