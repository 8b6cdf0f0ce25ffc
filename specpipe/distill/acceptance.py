"""Held-out acceptance of a draft by drafted position, greedy, on the target's own answers: per position, given the
earlier positions accepted (what a chain sees), for a model draft and for an EAGLE-3 head alike.

Draft position k = the k-th token drafted after a verify; an anchor is where a chain starts (teacher row a = the
target's distribution over token a+1 is position 1's). Summaries:
    agreement[k]    share of anchors where position k's argmax is the target's greedy token, the true tokens before
                    it fed in (position 1 = the K=1 acceptance rate);
    conditional[k]  the same among anchors whose positions 1..k-1 were all right: the acceptance of position k in a
                    chain, what speculative decoding sees;
    accepted_len    expected accepted drafted tokens per verify at K = positions (bonus token excluded).
With `lookup_below` (a head only), an anchor where the head's top probability at position 1 is under it and prompt
lookup finds a match in the tokens so far is drafted as the decoder drafts it (speculative/eagle3.py): positions 1..
are the lookup's copy (at most LOOKUP_MAX_TOKENS of them; a position past the copy is a miss).
A model draft reads only tokens, so with the true tokens fed in, its agreement at position k is its position-1
agreement at a later row (its conditional acceptance still differs: a chain that got this far is on easier text);
a head drafts positions k > 1 from its own states, so its later positions can be worse than its first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specpipe.distill.teacher import TeacherSequence

POSITIONS = 3  # draft positions measured


@dataclass
class ChainHits:
    """hits[k][a]: draft position k+1 from anchor a was the target's greedy token (true tokens before it)."""

    hits: torch.Tensor  # [positions, anchors] bool

    @classmethod
    def cat(cls, parts: list["ChainHits"], positions: int) -> "ChainHits":
        return cls(torch.cat([p.hits for p in parts], dim=1) if parts else torch.zeros((positions, 0), dtype=torch.bool))

    def summary(self) -> dict:
        hits = self.hits
        positions, anchors = hits.shape
        if not anchors:
            return {"anchors": 0, "agreement": [0.0] * positions, "conditional": [0.0] * positions, "accepted_len": 0.0,
                    "stderr_pos1": None}
        chain = hits.long().cumprod(0).float().mean(1)  # P(positions 1..k all right)
        agreement = hits.float().mean(1)
        conditional = [float(chain[0])] + [float(chain[k] / chain[k - 1]) if chain[k - 1] > 0 else 0.0
                                           for k in range(1, positions)]
        return {"anchors": anchors, "agreement": [round(float(a), 4) for a in agreement],
                "conditional": [round(c, 4) for c in conditional],
                "accepted_len": round(float(chain.sum()), 4),
                # binomial standard error of position 1, to read differences against
                "stderr_pos1": round(math.sqrt(max(float(agreement[0]) * (1 - float(agreement[0])), 1e-9) / max(1, anchors)), 4)}


def _answer_rows(seq: TeacherSequence, positions: int) -> tuple[int, int]:
    """First and last anchor whose positions 1..`positions` all predict answer tokens the sequence holds, as teacher
    rows of position 1 (teacher row r = the target's distribution over token r+1)."""
    start = max(seq.prompt_len - 1, 0)
    return start, len(seq) - 2 - (positions - 1)


@torch.inference_mode()
def model_chain_hits(student, sequences: list[TeacherSequence], positions: int = POSITIONS) -> ChainHits:
    """A model draft: one forward pass per sequence; position k from anchor r is its argmax at teacher row r+k-1."""
    student.eval()
    device = next(student.parameters()).device
    parts = []
    for seq in sequences:
        first, last = _answer_rows(seq, positions)
        if last < first:
            continue
        logits = student(input_ids=seq.token_ids[None].to(device)).logits[0, :-1].float().cpu()
        row_hits = logits.argmax(-1) == seq.top_ids[:, 0].long()  # [T-1]
        parts.append(ChainHits(torch.stack([row_hits[first + k : last + 1 + k] for k in range(positions)])))
    return ChainHits.cat(parts, positions)


@torch.inference_mode()
def head_chain_hits(head, sequences: list[TeacherSequence], positions: int = POSITIONS,
                    lookup_below: float = 0.0) -> ChainHits:
    """An EAGLE-3 head: position k from anchor r is unrolled step k-1 of head row r-1 (eagle3.py's indexing).
    `lookup_below` > 0: prompt lookup drafts where the head is unsure (module docstring)."""
    return head_chain_hits_alone_and_with_lookup(head, sequences, lookup_below, positions)[1]


@torch.inference_mode()
def head_chain_hits_alone_and_with_lookup(head, sequences: list[TeacherSequence], lookup_below: float,
                                          positions: int = POSITIONS) -> tuple[ChainHits, ChainHits]:
    """The head's chains alone and with prompt lookup where it is unsure (`lookup_below`), from one unroll per
    sequence: the head's own hits are the same in both, the lookup only replaces the anchors it drafts."""
    from specpipe.distill.eagle3_train import collate_head
    from specpipe.speculative.eagle3 import LOOKUP_MAX_TOKENS
    from specpipe.speculative.ngram import NgramDrafter

    head.eval()
    device = head.d2t.device
    alone, looked = [], []
    for seq in sequences:
        first, last = _answer_rows(seq, positions)
        if last < first or first < 1:
            continue
        features, tokens, valid, top_ids, _, _ = (t.to(device) for t in collate_head([seq], 0, positions, prompt_weight=0.0))  # weights unread
        states = head.unrolled(features, tokens, valid, positions)
        rows = []
        target = seq.top_ids[:, 0].long()
        for step, state in enumerate(states):
            logits = head.logits(state[0])
            predicted = head.draft_to_target(logits.argmax(-1)).cpu()  # row i -> teacher row i+step+1
            rows.append(predicted[first - 1 : last] == target[first + step : last + 1 + step])
            if step == 0:
                first_logits = logits
        hits = torch.stack(rows)
        alone.append(ChainHits(hits))
        if lookup_below > 0:
            hits = hits.clone()
            unsure = torch.softmax(first_logits.float(), -1).max(-1).values.cpu()[first - 1 : last] < lookup_below
            lookup, tokens = NgramDrafter().new_request(), seq.token_ids.tolist()
            for a in torch.nonzero(unsure).flatten().tolist():
                r = first + a  # teacher row r scores token r + 1; the context is tokens 0..r
                copy = lookup.propose(tokens[: r + 1], min(positions, LOOKUP_MAX_TOKENS), None, None).tokens
                if copy:
                    hits[:, a] = torch.tensor([k < len(copy) and copy[k] == int(target[r + k]) for k in range(positions)])
        looked.append(ChainHits(hits))
    return ChainHits.cat(alone, positions), ChainHits.cat(looked, positions)
