"""Distillation training: the draft learns the target's next-token distribution from cached teacher top-k.

Loss at a position (Hinton-style soft cross-entropy, equal to KL(p || q) up to a constant):
    - sum_{j in top-k} p_j log q_C(j)
where p is the target's top-k distribution (renormalized) and q_C the draft's softmax over a candidate
set C rather than all V tokens: every token in the batch's teacher top-k plus `negatives` tokens drawn
uniformly. The V-way head is the costliest part of a small draft's step, and C is a few thousand wide,
so each step is several times cheaper, while every token a teacher ever ranks high is scored.

The learning rate follows the budget: linear warm-up, then cosine decay over the tokens of a work budget
(--train-tokens: the same training on any machine) or over the clock (--minutes alone: a run ends
annealed whatever the machine's speed, but a slower machine trains less). Training state is saved every
N steps so a stopped run continues with --resume.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from specpipe.distill.teacher import TeacherSequence

WARMUP_STEPS = 20
EVALS_PER_BUDGET = 10  # held-out evaluations over a work budget
FINAL_LR_FRACTION = 0.05


@dataclass
class TrainState:
    step: int = 0
    elapsed_s: float = 0.0
    tokens_seen: int = 0
    epoch: int = 0
    cursor: int = 0  # batches of the current epoch already used
    recent_loss: float = float("nan")
    recent_agreement: float = float("nan")
    history: list = field(default_factory=list)  # (step, elapsed_s, loss, agreement)
    evals: list = field(default_factory=list)  # (step, elapsed_s, held-out agreement)


@dataclass
class StepReport:
    step: int
    elapsed_s: float
    budget_s: float
    loss: float
    agreement: float  # share of positions where the draft's top candidate is the target's top-1
    tokens_per_s: float
    tokens_seen: int = 0


def _batches(sequences: list[TeacherSequence], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Shuffle, then sort windows of 64 sequences by length and cut them into batches of about
    `batch_tokens` padded tokens: little padding, random batch composition."""
    order = list(range(len(sequences)))
    rng.shuffle(order)
    batches = []
    for start in range(0, len(order), 64):
        window = sorted(order[start : start + 64], key=lambda i: len(sequences[i]))
        current: list[int] = []
        for index in window:
            longest = max([len(sequences[i]) for i in current] + [len(sequences[index])])
            if current and longest * (len(current) + 1) > batch_tokens:
                batches.append(current)
                current = []
            current.append(index)
        if current:
            batches.append(current)
    rng.shuffle(batches)
    return batches


def _collate(sequences: list[TeacherSequence], prefix_len: int, prompt_weight: float):
    """Right-padded batch: input ids [B, T], attention mask [B, T], teacher ids/log-probs [B, T-1, k],
    loss weights [B, T-1] (0 on padding and on the shared chat-template prefix, `prompt_weight` on prompt rows)."""
    width = max(len(s) for s in sequences)
    k = sequences[0].top_ids.shape[1]
    batch = len(sequences)
    input_ids = torch.zeros((batch, width), dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    top_ids = torch.zeros((batch, width - 1, k), dtype=torch.long)
    top_lp = torch.full((batch, width - 1, k), -1e4, dtype=torch.float32)
    weights = torch.zeros((batch, width - 1))
    for row, seq in enumerate(sequences):
        n = len(seq)
        input_ids[row, :n] = seq.token_ids
        mask[row, :n] = 1
        top_ids[row, : n - 1] = seq.top_ids.long()
        top_lp[row, : n - 1] = seq.top_logprobs.float()
        # Row t predicts token t+1; answer rows start at prompt_len - 1.
        weights[row, : n - 1] = 1.0
        answer_start = max(seq.prompt_len - 1, 0)
        weights[row, :answer_start] = prompt_weight
        weights[row, : min(prefix_len, answer_start)] = 0.0
    return input_ids, mask, top_ids, top_lp, weights


def shared_prefix_len(sequences: list[TeacherSequence]) -> int:
    """Tokens every prompted sequence starts with (the chat template's system part): nothing to learn there."""
    prompted = [s.token_ids for s in sequences if s.prompt_len > 0]
    if len(prompted) < 2:
        return 0
    first = prompted[0]
    length = min(len(s) for s in prompted)
    for other in prompted[1:]:
        same = (other[:length] == first[:length]).long()
        length = int(same.cumprod(0).sum())
    return length


# Matrix products in a few shapes only: oneDNN builds (JITs) a kernel for each new shape of a bf16 product, and a
# batch's rows and candidates differ every step. On an Intel CPU with AMX a [850, 3900] x [3900, 576] bf16 product took
# 25 ms in a new shape against 3.9 ms in a shape seen before (docs/eagle3.md 3w). So the loss's product has its rows and
# candidates rounded up to multiples of SHAPE_BUCKET (the padding is sliced off after it: the other entries are unchanged).
SHAPE_BUCKET = 64


def bucketed(size: int, bucket: Optional[int] = None) -> int:
    """`size` rounded up to a multiple of `bucket` (SHAPE_BUCKET when not given)."""
    bucket = bucket or SHAPE_BUCKET
    return -(-size // bucket) * bucket


def candidate_logits(hidden: torch.Tensor, head: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """hidden [N, H] @ head[candidates].T -> [N, C], computed as a product of bucketed shape (padding rows of hidden
    are zeros, padding candidates repeat the last one) and sliced back."""
    rows, columns = hidden.shape[0], candidates.shape[0]
    hidden = torch.nn.functional.pad(hidden, (0, 0, 0, bucketed(rows) - rows))
    candidates = torch.cat([candidates, candidates[-1:].expand(bucketed(columns) - columns)])  # no device sync
    return (hidden @ head[candidates].T)[:rows, :columns]


def distill_loss(hidden: torch.Tensor, head: torch.Tensor, top_ids: torch.Tensor, top_lp: torch.Tensor,
                 weights: torch.Tensor, negatives: int, generator: torch.Generator) -> tuple[torch.Tensor, float]:
    """Soft cross-entropy against the teacher over a candidate set; returns (loss, top-1 agreement).

    hidden [N, H] (positions with weight > 0), head [V, H], top_ids [N, k], top_lp [N, k], weights [N].
    """
    vocab = head.shape[0]
    # Drawn on the CPU generator (saved with the training state), then moved to the head's device.
    negative_ids = (torch.randint(0, vocab, (negatives,), generator=generator).to(top_ids.device) if negatives > 0
                    else top_ids.new_zeros(0))
    if negatives >= vocab:
        candidates = torch.arange(vocab, device=top_ids.device)
    else:
        candidates = torch.unique(torch.cat([top_ids.flatten(), negative_ids]))  # sorted
    logits = candidate_logits(hidden, head, candidates)  # [N, C]
    log_q = torch.log_softmax(logits.float(), dim=-1)
    columns = torch.searchsorted(candidates, top_ids)  # [N, k]: where each teacher token sits in C
    p = torch.softmax(top_lp, dim=-1)  # renormalized over the top-k
    per_position = -(p * log_q.gather(1, columns)).sum(-1)
    loss = (per_position * weights).sum() / weights.sum().clamp(min=1e-6)
    with torch.no_grad():
        agreement = float((candidates[logits.argmax(-1)] == top_ids[:, 0]).float().mean())
    return loss, agreement


def lr_at(state: TrainState, budget_s: float, peak_lr: float, budget_tokens: Optional[int] = None) -> float:
    """Linear warm-up, then a cosine from peak_lr down to FINAL_LR_FRACTION of it over the run. The run's progress is
    how much of its budget is spent: of the tokens (a work budget) or of the time cap, whichever is further along, so
    a run the cap stops still ends at the low rate (on a slow CPU the demo's training stopped at 452k of 900k tokens
    with the rate at half its peak)."""
    if state.step < WARMUP_STEPS:
        return peak_lr * (state.step + 1) / WARMUP_STEPS
    progress = state.elapsed_s / budget_s
    if budget_tokens:
        progress = max(progress, state.tokens_seen / budget_tokens)
    progress = min(1.0, progress)
    return peak_lr * (FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainer:
    def __init__(self, student, sequences: list[TeacherSequence], *, budget_s: float, lr: float, batch_tokens: int,
                 negatives: int, prompt_weight: float, seed: int, state_path: Path, checkpoint_every: int, dtype: str = "float32",
                 budget_tokens: Optional[int] = None, held_out: Optional[list[TeacherSequence]] = None,
                 eval_every_s: float = 30.0):
        if not sequences:
            raise ValueError("no teacher data to train on")
        self.student, self.sequences = student, sequences
        self.budget_s, self.peak_lr, self.batch_tokens, self.negatives = budget_s, lr, batch_tokens, negatives
        # Prompt positions teach a draft to read prompts, which it never drafts: DistillConfig.prompt_weight, by kind.
        self.budget_tokens, self.prompt_weight = budget_tokens, prompt_weight
        self.seed, self.state_path, self.checkpoint_every = seed, Path(state_path), checkpoint_every
        # Matmul precision under autocast (master weights stay fp32); precision.py chooses it by measuring.
        self.dtype = dtype
        self.device = next(student.parameters()).device
        self.prefix_len = shared_prefix_len(sequences)
        self.optimizer = torch.optim.AdamW(student.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
        self.state = TrainState()
        self.generator = torch.Generator().manual_seed(seed)
        self._epoch_batches = _batches(sequences, batch_tokens, random.Random(seed))
        # With a few hundred answers a draft overfits within minutes (FINDINGS): agreement on held-out
        # answers is measured as training goes, and the best weights are the ones kept.
        self.held_out, self.eval_every_s = held_out or [], eval_every_s
        self.best: Optional[tuple[float, int, dict]] = None  # (agreement, step, state_dict)

    # ---- restartable state ----
    def save(self) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        torch.save({"model": self.student.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "state": self.state.__dict__, "generator": self.generator.get_state(), "best": self.best}, tmp)
        tmp.rename(self.state_path)

    def load(self) -> None:
        saved = torch.load(self.state_path, weights_only=False)
        self.student.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.state = TrainState(**saved["state"])
        self.generator.set_state(saved["generator"])
        self.best = saved.get("best")
        self._epoch_batches = _batches(self.sequences, self.batch_tokens, random.Random(self.seed + self.state.epoch))

    # ---- the loop ----
    def _next_batch(self) -> list[TeacherSequence]:
        if self.state.cursor >= len(self._epoch_batches):
            self.state.epoch += 1
            self.state.cursor = 0
            self._epoch_batches = _batches(self.sequences, self.batch_tokens, random.Random(self.seed + self.state.epoch))
        batch = self._epoch_batches[self.state.cursor]
        self.state.cursor += 1
        return [self.sequences[i] for i in batch]

    def _loss(self, batch: list[TeacherSequence], dtype: str) -> tuple[torch.Tensor, float, int]:
        """Forward pass and loss on a batch: (loss, top-1 agreement, tokens)."""
        input_ids, mask, top_ids, top_lp, weights = (t.to(self.device) for t in _collate(batch, self.prefix_len, self.prompt_weight))
        self.student.train()
        with torch.autocast(self.device.type, dtype=getattr(torch, dtype), enabled=dtype != "float32"):
            hidden = self.student.model(input_ids=input_ids, attention_mask=mask).last_hidden_state[:, :-1]
            keep = weights > 0
            loss, agreement = distill_loss(hidden[keep], self.student.get_output_embeddings().weight, top_ids[keep],
                                           top_lp[keep], weights[keep], self.negatives, self.generator)
        return loss, agreement, int(mask.sum())

    def probe(self, dtype: str, tokens: int = 128) -> Callable[[], int]:
        """A forward and backward pass in `dtype` on real sequences cut to about `tokens` tokens, for
        precision.compare; it leaves the weights, the optimizer and the batch order untouched."""
        generator_state = self.generator.get_state()
        cut = max(8, tokens // 2)
        batch = [s.cut(cut) for s in self.sequences[:2]]

        def call() -> int:
            loss, _, used = self._loss(batch, dtype)
            loss.backward()
            self.student.zero_grad(set_to_none=True)
            self.generator.set_state(generator_state)
            return used

        return call

    def step(self) -> tuple[float, float, int]:
        """One optimizer step on the next batch: (loss, top-1 agreement on the batch, tokens)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.state, self.budget_s, self.peak_lr, self.budget_tokens)
        loss, agreement, tokens = self._loss(self._next_batch(), self.dtype)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.student.parameters(), 1.0)
        self.optimizer.step()
        self.state.step += 1
        self.state.tokens_seen += tokens
        return float(loss.detach()), agreement, tokens

    def done(self) -> bool:
        """The work budget is spent (or, without one, the time budget); the time budget always caps."""
        if self.budget_tokens is not None and self.state.tokens_seen >= self.budget_tokens:
            return True
        return self.state.elapsed_s >= self.budget_s

    def _eval_due(self) -> bool:
        if self.done():
            return True
        if self.budget_tokens is not None:  # by tokens, so the kept weights do not depend on the machine's speed
            every = max(1, self.budget_tokens // EVALS_PER_BUDGET)
            last = self.state.evals[-1][3] if self.state.evals and len(self.state.evals[-1]) > 3 else 0
            return self.state.tokens_seen - last >= every
        return self.state.elapsed_s - self._last_eval_s() >= self.eval_every_s

    def run(self, on_step: Optional[Callable[[StepReport], None]] = None) -> TrainState:
        """Train until the budget (counted across restarts) is spent."""
        state = self.state
        window_tokens, window_s = 0, 0.0
        while not self.done():
            t0 = time.perf_counter()
            loss, agreement, tokens = self.step()
            dt = time.perf_counter() - t0
            state.elapsed_s += dt
            smooth = 0.9 if state.step > 1 and not math.isnan(state.recent_loss) else 0.0
            state.recent_loss = smooth * state.recent_loss + (1 - smooth) * loss if smooth else loss
            state.recent_agreement = smooth * state.recent_agreement + (1 - smooth) * agreement if smooth else agreement
            window_tokens, window_s = window_tokens + tokens, window_s + dt
            if state.step % 10 == 0:
                state.history.append((state.step, round(state.elapsed_s, 1), round(state.recent_loss, 4),
                                      round(state.recent_agreement, 4)))
            if self.checkpoint_every and state.step % self.checkpoint_every == 0:
                self.save()
            if on_step is not None:
                on_step(StepReport(state.step, state.elapsed_s, self.budget_s, state.recent_loss,
                                   state.recent_agreement, window_tokens / window_s if window_s else 0.0,
                                   state.tokens_seen))
            if window_s > 20:
                window_tokens, window_s = 0, 0.0
            if self.held_out and self._eval_due():
                t0 = time.perf_counter()
                self._evaluate()
                state.elapsed_s += time.perf_counter() - t0  # evaluation time counts against the budget
        if self.held_out and self.best is not None:
            if not state.evals or state.evals[-1][0] != state.step:
                self._evaluate()
            self.student.load_state_dict(self.best[2])
        self.student.eval()
        return state

    def _last_eval_s(self) -> float:
        return self.state.evals[-1][1] if self.state.evals else 0.0

    def _evaluate(self) -> None:
        score = agreement(self.student, self.held_out)
        self.state.evals.append((self.state.step, round(self.state.elapsed_s, 1), round(score, 4), self.state.tokens_seen))
        if self.best is None or score > self.best[0]:
            self.best = (score, self.state.step, {k: v.detach().clone() for k, v in self.student.state_dict().items()})


@torch.inference_mode()
def agreement(student, sequences: list[TeacherSequence], *, answers_only: bool = True) -> float:
    """Share of positions where the draft's argmax over the full vocabulary equals the target's top-1.

    On the target's own greedy answers this is the greedy acceptance rate of a K=1 draft.
    """
    student.eval()
    device = next(student.parameters()).device
    hits = total = 0
    for seq in sequences:
        logits = student(input_ids=seq.token_ids[None].to(device)).logits[0, :-1].cpu()
        start = max(seq.prompt_len - 1, 0) if answers_only else 0
        hits += int((logits[start:].argmax(-1) == seq.top_ids[start:, 0].long()).sum())
        total += len(seq) - 1 - start
    return hits / total if total else 0.0
