"""The accuracy budget: a quantized engine against the unquantized engine of the same model.

Notation: p_ref = next-token probabilities of the unquantized (reference) engine, p_quant = those of the
quantized engine, both teacher-forced on the same token sequences (held-out text and prompts disjoint
from calibration). Over every position that has a next token in the sequence:

- perplexity = exp(mean negative log-likelihood of the actual next token), for each engine;
  ppl_rel_change = ppl_quant / ppl_ref - 1  (+0.05 = 5% worse);
- top1_agreement = share of positions where argmax p_quant == argmax p_ref (this is what greedy
  decoding and a greedy draft's acceptance depend on);
- mean_kl = mean over positions of KL(p_ref || p_quant), in nats.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from specpipe.config import THREADS
from specpipe.contract.quant import AccuracyBudget, AccuracyReport
from specpipe.errors import AccuracyBudgetError, UsageError


@dataclasses.dataclass(frozen=True)
class BudgetViolation:
    metric: str
    value: float
    limit: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (KL of nearly equal distributions needs the precision)."""
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def sequence_logits(engine, token_ids: Sequence[int]) -> np.ndarray:
    """Logits for every position of `token_ids` from an empty cache: float32 [len(token_ids), vocab]."""
    return engine.new_sequence().append(list(token_ids))


def measure_accuracy(ref_dir: Path, quant_dir: Path, token_batches: Sequence[Sequence[int]], *, threads: int = THREADS) -> AccuracyReport:
    """Compare the engine in `quant_dir` with the one in `ref_dir` on `token_batches` (see module docstring)."""
    from specpipe.engines import load_engine, read_engine_meta

    ref, quant = load_engine(ref_dir, threads=threads), load_engine(quant_dir, threads=threads)
    vocab = min(ref.vocab_size, quant.vocab_size)
    return compare_models(lambda ids: sequence_logits(ref, ids)[:, :vocab], lambda ids: sequence_logits(quant, ids)[:, :vocab],
                          token_batches, mode=str(read_engine_meta(quant_dir).get("quant", "none")),
                          next_tokens=lambda ids: _scored_next_tokens(ref, ids))


def compare_models(ref_logits: Callable[[list[int]], np.ndarray], quant_logits: Callable[[list[int]], np.ndarray],
                   token_batches: Sequence[Sequence[int]], *, mode: str,
                   next_tokens: Optional[Callable[[list[int]], tuple[np.ndarray, np.ndarray]]] = None) -> AccuracyReport:
    """The module docstring's metrics for any two models given as `logits(token_ids) -> [len(token_ids), vocab]`
    from an empty cache (specpipe's engines, or another runtime's: bench/peers). `next_tokens(ids)`: the
    (positions, logit columns) of the scored next tokens; default every position, column = token id."""
    batches = [list(b) for b in token_batches if len(b) >= 2]
    if not batches:
        raise UsageError("the accuracy check needs at least one sequence of 2 or more tokens")
    nll_ref, nll_quant, agree, kl = [], [], [], []
    for token_ids in batches:
        # The last position has no next token in the sequence: drop it from every metric alike.
        logp_ref = log_softmax(ref_logits(token_ids)[:-1])  # [T-1, V]
        logp_quant = log_softmax(quant_logits(token_ids)[:-1])  # [T-1, V]
        rows, next_ids = next_tokens(token_ids) if next_tokens else (np.arange(len(token_ids) - 1), np.asarray(token_ids[1:]))
        nll_ref.append(-logp_ref[rows, next_ids])
        nll_quant.append(-logp_quant[rows, next_ids])
        agree.append(logp_ref.argmax(-1) == logp_quant.argmax(-1))
        kl.append((np.exp(logp_ref) * (logp_ref - logp_quant)).sum(-1))
    nll_ref, nll_quant, agree, kl = (np.concatenate(x) for x in (nll_ref, nll_quant, agree, kl))
    ppl_ref, ppl_quant = float(np.exp(nll_ref.mean())), float(np.exp(nll_quant.mean()))
    return AccuracyReport(
        mode=mode,
        num_sequences=len(batches),
        num_positions=int(agree.size),
        ppl_ref=ppl_ref,
        ppl_quant=ppl_quant,
        ppl_rel_change=ppl_quant / ppl_ref - 1.0,
        top1_agreement=float(agree.mean()),
        mean_kl=float(max(kl.mean(), 0.0)),  # rounding can make an exact match a hair negative
        max_kl=float(max(kl.max(), 0.0)),
    )


def _scored_next_tokens(engine, token_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(positions, logit columns) of the next tokens: position t predicts token t+1. A sliced draft head
    (engine.token_ids) scores only its kept tokens, so perplexity is over the positions whose next token
    it keeps (both engines compared have the same columns)."""
    next_ids = np.asarray(token_ids[1:])
    if engine.token_ids is None:
        return np.arange(len(next_ids)), next_ids
    column = np.full(max(int(engine.token_ids.max()), int(next_ids.max())) + 1, -1)
    column[engine.token_ids] = np.arange(len(engine.token_ids))
    rows = np.flatnonzero(column[next_ids] >= 0)
    return rows, column[next_ids[rows]]


def budget_violations(report: AccuracyReport, budget: AccuracyBudget) -> list[BudgetViolation]:
    """Every metric of `report` that is over `budget`, in a fixed order (perplexity, top-1, KL)."""
    checks = [
        ("perplexity increase", report.ppl_rel_change, budget.max_ppl_increase, report.ppl_rel_change > budget.max_ppl_increase),
        ("top-1 agreement", report.top1_agreement, budget.min_top1_agreement, report.top1_agreement < budget.min_top1_agreement),
    ]
    if budget.max_mean_kl is not None:
        checks.append(("mean KL", report.mean_kl, budget.max_mean_kl, report.mean_kl > budget.max_mean_kl))
    # NaN compares False everywhere: a quantization that produced NaN logits must not pass silently.
    nan = [BudgetViolation(name, value, limit) for name, value, limit, _ in checks if not np.isfinite(value)]
    return nan or [BudgetViolation(name, value, limit) for name, value, limit, over in checks if over]


def check_budget(report: AccuracyReport, budget: AccuracyBudget, model_name: str, *, accept_loss: bool = False) -> list[BudgetViolation]:
    """Raise AccuracyBudgetError for the first metric over budget, unless `accept_loss`.

    Returns all violations (empty when within budget) so the manifest can record every one of them.
    """
    violations = budget_violations(report, budget)
    if violations and not accept_loss:
        first = violations[0]
        raise AccuracyBudgetError(model_name, first.metric, first.value, first.limit, mode=report.mode)
    return violations


def greedy_agreement(draft_dir: Path, target_dir: Path, token_batches: Sequence[Sequence[int]], *, threads: int = THREADS) -> float:
    """Share of positions where the draft's argmax equals the target's, teacher-forced on `token_batches`.

    A cheap stand-in for the greedy acceptance rate of single drafted tokens; compare it for the fp32 and
    the quantized draft against the same target to see what quantizing the draft costs in acceptance.
    """
    from specpipe.engines import load_engine

    draft, target = load_engine(draft_dir, threads=threads), load_engine(target_dir, threads=threads)

    def greedy_tokens(engine, ids) -> np.ndarray:
        logits = sequence_logits(engine, ids)
        if engine.token_ids is not None:  # a sliced draft head: its columns are these tokens
            return engine.token_ids[logits.argmax(-1)]
        return logits[:, : min(draft.vocab_size, target.vocab_size)].argmax(-1)

    matches = [greedy_tokens(draft, ids) == greedy_tokens(target, ids) for ids in token_batches if len(ids) >= 1]
    if not matches:
        raise UsageError("greedy agreement needs at least one non-empty sequence")
    return float(np.concatenate(matches).mean())
