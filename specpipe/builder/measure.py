"""What `specpipe build` measures on the engines it has just built, on this machine, for the manifest.

    step costs         c and b of adaptive K (speculative/adaptive.py): a draft step and each verified token,
                       relative to one target step
    batch costs        batched one-token steps by rows, for the load-adaptive batch planner
    target_min_rows    whether the target scores a position alike alone and inside a verify call, and the
                       rows per call that make it so (`rows_per_call`: none without a draft)
    precisions         --quant auto: fp32 and the quantized targets' batched steps, timed in turn
                       (`measure_precisions`); which one is deployed is quant_choice.py's `choose`
    candidates         several --draft candidates against the target alone (`measure_candidates`); which one
                       is deployed is draft_choice.py's `choose`

Candidate measurement: greedy, adaptive K with the step costs measured for each candidate at build, on the
first few packaged bench prompts (chat template applied). The target alone runs in the same loop, each prompt
through every row back to back (bench/harness.py `run_rows`), so load on a shared machine slows every row
alike and the ratios hold. speedup = the candidate's median tokens/s / the target alone's, as in `bench`.

The verify curve a candidate is recorded with (its step_costs.verify: what the deployment's adaptive K and the
prediction read) is then the one its decoding paid on the sample (`in_decoding_curve`): each verify call's time
over the target alone's 1-token steps in the same run, beside the draft's own calls. Timed alone on a 64-token
cache, one engine's 2-token call read 1.04 to 1.18 of a step across readings on a Zen 4, and 1.15 in decoding.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from specpipe.bench.harness import PADDED_BASELINE, SpecRow, run_rows, summarize
from specpipe.bench.prompts import load_prompt_sets
from specpipe.builder.config import BuildConfig, DraftChoiceConfig
from specpipe.builder.draft_choice import NONE
from specpipe.contract.costs import BatchCosts, StepCosts
from specpipe.contract.manifest import CandidateMeasurement, ConsistencyRecord, DraftEntry
from specpipe.drafts import kind_named, make_drafter
from specpipe.engines import load_engine
from specpipe.engines.base import Engine
from specpipe.engines.onnxruntime import TARGET_MIN_ROWS
from specpipe.engines.timing import (VERIFY_CURVE_TOKENS, batch_step_ms, batch_steps_ms, calls_ms, curve_of, head_step_ms,
                                     in_decoding_curve, pooled_calls, step_ms, target_step)
from specpipe.speculative.adaptive import predicted_speedup
from specpipe.speculative.drafters import Drafter
from specpipe.speculative.stats import calls_summary
from specpipe.speculative.generator import SpecGenerator

def measure_step_costs(target, draft=None, *, head=None, verify_tokens: int = 8) -> StepCosts:
    """Time the engines alone on a 64-token cache (medians): a target call on 1, on 1 + k tokens for the first
    few k (the verify curve) and on 1 + verify_tokens tokens, and a draft step of the draft engine or of an EAGLE-3
    `head` (engines/eagle3_head.py; each after a target step, as in decoding). Prompt lookup (no draft engine)
    costs nothing."""
    ms = calls_ms(target, [1, *range(2, 2 + VERIFY_CURVE_TOKENS), 1 + verify_tokens])  # in turns: their ratios hold
    one, many = ms[1], ms[1 + verify_tokens]
    draft_ms = (step_ms(draft, 1) if draft is not None
                else head_step_ms(head, between=target_step(target)) if head is not None else 0.0)
    return StepCosts(
        draft=draft_ms / one,
        verify_per_token=max(many - one, 0.0) / verify_tokens / one,
        verify=curve_of(ms, one),
    )


def measure_batch_costs(target, max_rows: int, *, context_len: int = 64, repeats: int = 5) -> BatchCosts:
    """Time batched one-token steps of the target (or of a draft: the manifest's draft_batch_costs) for 1, 2,
    4, ... up to `max_rows` rows, each row holding a `context_len`-token cache (medians of `repeats`). An
    engine without batched calls is timed too: its rows then cost n lone steps, which the planner reads as
    "batching saves nothing"."""
    return BatchCosts({n: batch_step_ms(target, n, context_len=context_len, repeats=repeats) for n in batch_sizes(max_rows)})


def batch_sizes(max_rows: int) -> list[int]:
    """The rows batched steps are timed at: 1, 2, 4, ... up to `max_rows`, and `max_rows` itself."""
    return sorted({n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max_rows} | {max_rows})


def measure_precisions(folders: dict[str, Path], min_rows: dict[str, int], max_rows: int, threads: int, *,
                       repeats: int = 9, context_len: int = 64) -> dict[str, dict[int, float]]:
    """--quant auto: one target built at several precisions ({mode: engine folder}), each opened with its
    rows per call (`min_rows`, as it would be served), timed as `measure_batch_costs` times one, at every size
    of `batch_sizes(max_rows)`; the engines take turns call by call (engines/timing.py `batch_steps_ms`), so
    their ratios hold on a loaded machine. Returns {mode: {rows: median ms of one batched one-token step}}."""
    modes = list(folders)
    engines = [load_engine(folders[mode], threads=threads, min_rows=min_rows[mode]) for mode in modes]
    by_rows = {n: batch_steps_ms(engines, n, context_len=context_len, repeats=repeats) for n in batch_sizes(max_rows)}
    return {mode: {n: ms[index] for n, ms in by_rows.items()} for index, mode in enumerate(modes)}


# Prompts on which the build checks that the target is one function (a code and a prose continuation).
CONSISTENCY_PROMPTS = ("def fibonacci(n):\n", "The capital of France is")


def measure_target_min_rows(folder: Path, quant_mode: str, cfg: BuildConfig, tokenizer, say: Callable[[str], None],
                            timings: dict) -> tuple[ConsistencyRecord, int]:
    """Whether the target scores a position alike in a 1-token decode and inside a verify call of K+1 = 5
    tokens (engines/consistency.py), and the rows per call that make it so, measured on this machine.

    ONNX Runtime's CPU kernels may run a 1-row MatMul/MatMulNBits through other code (engines/onnxruntime.py):
    on an AVX2 CPU int8/int4 weight-only targets moved logits by up to 1.8 that way, fp32 by 7e-5. Unpadded
    first; if twice the difference exceeds the near-tie tolerance, 1-token calls run as 2-row calls (~10%
    slower target-only steps, measured) and are measured again. Returns (manifest record, min_rows)."""
    from specpipe.engines.consistency import verify_consistency
    from specpipe.speculative.equivalence import near_tie_tolerance

    t0 = time.perf_counter()
    say("checking the target scores a position alike alone and inside a verify call")
    prompts = [ids for ids in (tokenizer(prompt)["input_ids"] for prompt in CONSISTENCY_PROMPTS) if ids]
    tolerance = near_tie_tolerance(quant_mode)
    unpadded = None
    for min_rows in (1, TARGET_MIN_ROWS):
        result = verify_consistency(load_engine(folder, threads=cfg.backend.threads, min_rows=min_rows), prompts, new_tokens=24,
                                    chunk=5)
        within = 2 * result.max_abs_logit_diff <= tolerance
        if within:
            break
        unpadded = unpadded if unpadded is not None else result.max_abs_logit_diff
    if not within:
        say(f"warning: the {quant_mode} target's logits differ by up to {result.max_abs_logit_diff:.3g} between a"
            f" 1-token decode and a verify call (near-tie tolerance {tolerance:g}): speculative greedy output may"
            " differ from target-only output")
    timings["target_consistency_s"] = time.perf_counter() - t0
    record = ConsistencyRecord(**result.as_dict(), near_tie_tolerance=tolerance, within_tolerance=within)
    if unpadded is not None:
        record.unpadded_max_abs_logit_diff = unpadded
    return record, min_rows


def rows_per_call(record: ConsistencyRecord, min_rows: int, draft: DraftEntry) -> tuple[ConsistencyRecord, int]:
    """The target's rows per call beside the deployed `draft`, from `measure_target_min_rows`'s answer.

    Padding a 1-token call to 2 rows makes it score like a verify call (GroupQueryAttention's multi-token path
    and MatMulNBits' multi-row kernels), and only that. A deployment without a draft never runs a verify call:
    its calls are prompts and 1-token steps, alone or batched, and a batched step is 1 token per row, the same
    path as an unpadded lone step. So it runs unpadded: faster alone, and exactly like its own batched steps,
    which padding would break. Measured on SmolLM2-135M int8-wo (Zen 4, 4 prompts x 24 greedy tokens):
    max |logit diff| of lone vs batched (2 and 4 rows) 1-token steps 0.0 unpadded, 1.81 padded to 2 rows;
    a lone step 12.2 ms unpadded vs 14.4 ms padded (1 thread, interleaved, load ~5)."""
    if draft.kind != NONE or min_rows == 1:
        return record, min_rows
    return record.model_copy(update={"verify_calls": False}), 1


def measure_built_step_costs(stage: Path, draft_entry: DraftEntry, cfg: BuildConfig, target_min_rows: int = 1) -> StepCosts:
    """Draft and verification costs relative to a target step, on these engines and this machine: adaptive
    K's inputs (speculative/adaptive.py). Recorded once, so every process serving the build drafts alike.
    A draft without an engine (prompt lookup, none) costs nothing."""
    target = load_engine(stage / "target", threads=cfg.backend.threads, min_rows=target_min_rows)
    drafter = make_drafter(stage, draft_entry, target, cfg.backend.threads)
    return measure_step_costs(target, getattr(drafter, "engine", None), head=getattr(drafter, "head", None))


def measure_built_draft_batch_costs(stage: Path, draft_entry: DraftEntry, cfg: BuildConfig, say: Callable[[str], None]) -> Optional[BatchCosts]:
    """Batched one-token steps of the draft engine by rows (a shared-KV draft runs them in one call; another
    draft's rows cost n lone steps): what the batch planner charges the speculating rows' drafts. None
    without a draft engine (prompt lookup, none)."""
    engine = getattr(draft_entry, "engine", None)
    if engine is None:
        return None
    say(f"timing batched draft steps (up to {cfg.backend.max_batch_size} requests)")
    return measure_batch_costs(load_engine(stage / engine.path, threads=cfg.backend.threads), cfg.backend.max_batch_size)


@dataclass
class Candidate:
    spec: str  # the --draft value
    kind: str  # its draft kind's name (specpipe/drafts/)
    drafter: Optional[Drafter]  # None for "none"
    costs: StepCosts  # measured on this machine for this candidate's engines
    # what was built, recorded with the measurement
    source: str
    weights_sha256: Optional[str] = None  # a draft checkpoint's
    build_timings_s: dict[str, float] = field(default_factory=dict)


def measure_candidates(target: Engine, candidates: Sequence[Candidate], tokenizer, eos_token_ids: Sequence[int],
                       cfg: DraftChoiceConfig, *, max_draft_len: int, alone: Optional[Engine] = None,
                       progress: Callable[[str], None] = lambda msg: None) -> list[CandidateMeasurement]:
    """One measurement per candidate, "none" (the target alone) first.

    `alone`: the target as a build without a draft deploys it (unpadded, `rows_per_call`), when `target` pads its
    1-token steps to verify rows. "none" is timed on it, so a draft must beat the deployment it would replace, not
    a padded target ~5-10% slower. Each candidate's output is checked against the padded target alone (a row of
    its own, not a candidate): that is the output speculation must equal; the unpadded target's greedy ids may
    differ from it by a kernel's rounding."""
    baseline = Candidate(NONE, "none", None, StepCosts(0.0, 0.0), source=NONE)
    rows = [_row(baseline, alone or target, tokenizer, eos_token_ids, max_draft_len)]
    if alone is not None and alone is not target:
        rows.append(_row(baseline, target, tokenizer, eos_token_ids, max_draft_len, label=PADDED_BASELINE))
    rows += [_row(c, target, tokenizer, eos_token_ids, max_draft_len) for c in candidates if c.kind != "none"]
    sets = load_prompt_sets([], list(cfg.choice_sets), cfg.choice_prompts)
    encode = rows[0].generator.encode
    prompts = [(p.id, encode(p.prompt, chat=_has_chat_template(tokenizer))) for s in sets for p in s.prompts]
    warmup = [prompts[i % len(prompts)][1] for i in range(cfg.warmup_prompts)]
    total, done = len(rows) * (len(prompts) + len(warmup)), 0
    padded = any(row.label == PADDED_BASELINE for row in rows)
    alone_text = "the target alone (unpadded as deployed, and padded as the candidates run it)" if padded else \
        "the target alone"
    progress(f"measuring {len(rows) - 1 - padded} candidates and {alone_text} on {len(prompts)} prompts, "
             f"{cfg.choice_tokens} new tokens each")

    def on_run(label: str, prompt_id: str) -> None:
        nonlocal done
        done += 1
        if label == rows[-1].label:  # a prompt went through every row
            progress(f"measuring the candidates: {done}/{total} runs")

    results = run_rows(rows, prompts, max_new_tokens=cfg.choice_tokens, warmup=warmup, on_run=on_run)
    by_spec = {c.spec: c for c in [baseline, *candidates]}
    # The candidates' step costs are in steps of the target as they run it, padded where it pads, while the deployment
    # a draft replaces runs unpadded: predictions are scaled by the padded target's rate over the unpadded one's, from
    # this run, so they say what the measurement says (an AVX2 Zen 3 build predicted 1.44x for a head measured at 1.14x
    # beside a padded target 0.80-0.89x as fast).
    padded_share = summarize(PADDED_BASELINE, "target-only", None, results[PADDED_BASELINE],
                             results[NONE])["speedup"] if padded else 1.0
    # The candidates' calls are in steps of the target as they run it: the padded baseline's 1-token steps, if any.
    one_token = [s for m in results[PADDED_BASELINE if padded else NONE] for s in m.call_s.get(1, [])]
    records = []
    for row in rows:
        if row.label == PADDED_BASELINE:
            continue
        reference = results.get(PADDED_BASELINE) if row.label != NONE else None
        summary = summarize(row.label, row.kind, None, results[row.label], results[NONE], reference)
        candidate, calls = by_spec[row.label], None
        if row.label != NONE:
            calls = pooled_calls(results[row.label])
            curve = in_decoding_curve(one_token, calls, candidate.costs.verify)
            if curve != candidate.costs.verify:
                progress(f"{row.label}: verify calls in decoding {_curve_text(curve)} of a step, timed alone "
                         f"{_curve_text(candidate.costs.verify)}: recorded as decoding paid them")
            candidate = dataclasses.replace(candidate, costs=dataclasses.replace(candidate.costs, verify=curve))
        record = _record(candidate, summary, max_draft_len, padded_share)
        if calls is not None:
            record.verify_timed = by_spec[row.label].costs.verify
            own = {n: seconds for n, seconds in calls.items() if n > 1}  # "1": the target alone's, the unit
            record.verify_calls = {**calls_summary({1: one_token}), **calls_summary(own)}
        records.append(record)
    return records


def _curve_text(curve: Sequence[float]) -> str:
    return "[" + ", ".join(f"{c:.3f}" for c in curve) + "]"


def _row(candidate: Candidate, target: Engine, tokenizer, eos_token_ids, max_draft_len: int,
         label: Optional[str] = None) -> SpecRow:
    generator = SpecGenerator(target, candidate.drafter, tokenizer, eos_token_ids, candidate.costs)
    alone = candidate.drafter is None
    policy = kind_named(candidate.kind).entry.policy(max_draft_len=max_draft_len)
    cfg = policy.request(0 if alone else None)  # greedy, adaptive K: as served
    return SpecRow(label or candidate.spec, generator, cfg, "target-only" if alone else "speculative", None)


def _record(candidate: Candidate, summary: dict, max_draft_len: int, padded_share: float = 1.0) -> CandidateMeasurement:
    """`padded_share`: the target as the candidates ran it, in tokens/s, over the target alone as deployed (1.0
    where the two are one engine); the candidate's step costs are in steps of the former."""
    alone = candidate.kind == "none"
    acceptance = None if alone else summary["acceptance_rate"]
    predicted = None
    kind = kind_named(candidate.kind)
    if kind.has_engine and acceptance is not None:
        ceiling = kind.entry.policy(max_draft_len=max_draft_len).adaptive_ceiling
        predicted = predicted_speedup(acceptance, candidate.costs, ceiling) * padded_share
    return CandidateMeasurement(
        draft=candidate.spec, kind=candidate.kind, prompts=summary["prompts"], tokens_generated=summary["tokens_generated"],
        tokens_per_s=summary["tokens_per_s"], speedup=summary["speedup"], acceptance_rate=acceptance,
        mean_accepted_len=None if alone else summary["mean_accepted_len"], matches_target=summary["matches_target"],
        step_costs=None if alone else candidate.costs, predicted_speedup=predicted, source=candidate.source,
        weights_sha256=candidate.weights_sha256, build_timings_s=candidate.build_timings_s,
    )  # fmt: skip


def _has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))

