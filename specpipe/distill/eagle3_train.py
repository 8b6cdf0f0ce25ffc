"""Training an EAGLE-3 head on teacher data with features: soft targets, training-time test, held-out agreement.

The loop, budgets, learning-rate schedule, checkpoints and best-weights rule are train.Trainer's; this file gives
it the head's batches, loss and evaluation. Loss of a batch = sum over unrolled steps k of w_k times the soft
cross-entropy of step k against the target's top-k (renormalized over the tokens the draft vocabulary holds), the
same candidate-set loss as the model draft (train.distill_loss). See distill/eagle3.py for the row/step indexing.
"""

from __future__ import annotations

from typing import Optional

import torch

from specpipe.distill.eagle3 import Eagle3HeadModule, step_weights
from specpipe.distill.teacher import TeacherSequence
from specpipe.distill.train import Trainer, bucketed, distill_loss

OUT_OF_VOCAB_LOGPROB = -1e4  # a teacher token the draft vocabulary lacks: weight ~0 after renormalizing
ROW_BUCKET = 16  # a batch's rows per sequence, rounded up to a multiple of this (collate_head)


def collate_head(sequences: list[TeacherSequence], prefix_len: int, steps: int, *, prompt_weight: float):
    """Right-padded batch for `steps` unrolled steps. Returns
    features [B, n, F]; tokens [B, n + steps - 1] (tokens[:, j] = t_{j+1}); valid [B, n];
    teacher ids / log-probs [B, n + steps, k] (teacher row r = the target's distribution over t_{r+1});
    row weights [B, n + steps] (0 past the end and on the shared chat prefix, `prompt_weight` on prompt rows).
    n = longest T - 1, rounded up to a multiple of ROW_BUCKET (rows past a sequence's end are not valid and weigh 0, so
    the loss is the same; the head's products then come in few shapes: train.SHAPE_BUCKET).
    Step k of row i reads tokens[:, i + k] and is taught teacher row i + k + 1."""
    n = bucketed(max(len(s) for s in sequences) - 1, ROW_BUCKET)
    k = sequences[0].top_ids.shape[1]
    batch = len(sequences)
    width = sequences[0].features.shape[1]
    features = torch.zeros((batch, n, width), dtype=torch.float32)
    tokens = torch.zeros((batch, n + steps - 1), dtype=torch.long)
    valid = torch.zeros((batch, n), dtype=torch.bool)
    top_ids = torch.zeros((batch, n + steps, k), dtype=torch.long)
    top_lp = torch.full((batch, n + steps, k), -1e4, dtype=torch.float32)
    weights = torch.zeros((batch, n + steps))
    for row, seq in enumerate(sequences):
        length = len(seq)  # T; rows 0..T-2 exist
        features[row, : length - 1] = seq.features[: length - 1].float()
        tokens[row, : length - 1] = seq.token_ids[1:]
        valid[row, : length - 1] = True
        top_ids[row, : length - 1] = seq.top_ids.long()
        top_lp[row, : length - 1] = seq.top_logprobs.float()
        weights[row, : length - 1] = 1.0
        answer_start = max(seq.prompt_len - 1, 0)
        weights[row, :answer_start] = prompt_weight
        weights[row, : min(prefix_len, answer_start)] = 0.0
    return features, tokens, valid, top_ids, top_lp, weights


class HeadTrainer(Trainer):
    """train.Trainer with the head's batches, loss and held-out evaluation (module docstring)."""

    def __init__(self, head: Eagle3HeadModule, sequences: list[TeacherSequence], *, steps: int, decay: float, **kwargs):
        self.steps, self.step_weights = steps, step_weights(steps, decay)
        super().__init__(head, sequences, **kwargs)

    def _loss(self, batch: list[TeacherSequence], dtype: str) -> tuple[torch.Tensor, float, int]:
        head = self.student
        features, tokens, valid, top_ids, top_lp, weights = (
            t.to(self.device) for t in collate_head(batch, self.prefix_len, self.steps,
                                                       prompt_weight=self.prompt_weight))
        n = features.shape[1]
        # Teacher tokens in draft-vocabulary indices; those the vocabulary lacks get ~0 weight.
        draft_ids = head.target_to_draft(top_ids)
        top_lp = torch.where(draft_ids >= 0, top_lp, torch.full_like(top_lp, OUT_OF_VOCAB_LOGPROB))
        # A row none of whose teacher tokens the vocabulary holds has nothing to teach (renormalized, its
        # distribution would land on the clamped id 0).
        weights = weights * (draft_ids >= 0).any(-1)
        draft_ids = draft_ids.clamp(min=0)
        head.train()
        total = features.new_zeros(())
        agreement = 0.0
        with torch.autocast(self.device.type, dtype=getattr(torch, dtype), enabled=dtype != "float32"):
            states = head.unrolled(features, tokens, valid, self.steps)
            for step, (state, weight) in enumerate(zip(states, self.step_weights)):
                rows = slice(step + 1, step + 1 + n)
                row_weights = weights[:, rows] * valid
                keep = row_weights > 0
                if not bool(keep.any()):
                    continue
                loss, step_agreement = distill_loss(head.norm(state[keep]), head.lm_head.weight, draft_ids[:, rows][keep],
                                                    top_lp[:, rows][keep], row_weights[keep], self.negatives,
                                                    self.generator)
                total = total + weight * loss
                if step == 0:
                    agreement = step_agreement
        return total, agreement, int(valid.sum())

    def _evaluate(self) -> None:
        scores = head_agreement(self.student, self.held_out, steps=self.steps)
        self.state.evals.append((self.state.step, round(self.state.elapsed_s, 1), round(scores[0], 4),
                                 self.state.tokens_seen, [round(s, 4) for s in scores]))
        if self.best is None or scores[0] > self.best[0]:
            self.best = (scores[0], self.state.step, {k: v.detach().clone() for k, v in self.student.state_dict().items()})


@torch.inference_mode()
def head_agreement(head: Eagle3HeadModule, sequences: list[TeacherSequence], *, steps: int = 1,
                   answers_only: bool = True) -> list[float]:
    """Per unrolled step k: share of answer positions where the head's argmax (over the draft vocabulary, mapped to
    target ids) equals the target's top-1. Step 0 is comparable to train.agreement for a model draft (both predict
    t_{r+1} from the tokens up to t_r); step k > 0 feeds the head its own states with the answer's tokens, i.e. the
    acceptance of draft position k+1 given that positions 1..k were accepted, on the target's greedy answers."""
    head.eval()
    device = head.d2t.device
    hits, totals = [0] * steps, [0] * steps
    for seq in sequences:
        features, tokens, valid, top_ids, _, _ = (t.to(device) for t in collate_head([seq], 0, steps, prompt_weight=0.0))  # weights unread
        n = features.shape[1]
        states = head.unrolled(features, tokens, valid, steps)
        start = max(seq.prompt_len - 1, 0) if answers_only else 0
        last = len(seq) - 2  # the last teacher row
        for step, state in enumerate(states):
            predicted = head.draft_to_target(head.logits(state[0]).argmax(-1))  # [n]: row i predicts teacher row i+step+1
            rows = torch.arange(n, device=device) + step + 1
            keep = (rows >= start) & (rows <= last)
            target = top_ids[0, step + 1 : step + 1 + n, 0]
            hits[step] += int(((predicted == target) & keep).sum())
            totals[step] += int(keep.sum())
    return [h / t if t else 0.0 for h, t in zip(hits, totals)]


def loss_curve(state) -> Optional[tuple[float, float]]:
    """(first, last) smoothed training loss in the history, for a quick 'did it learn' check."""
    if len(state.history) < 2:
        return None
    return state.history[0][2], state.history[-1][2]
