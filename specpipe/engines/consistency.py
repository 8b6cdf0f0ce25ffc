"""Is the target one function? Its logits for a position scored alone vs inside a multi-token call.

Speculative greedy decoding is lossless only if the target gives the same logits to a position whether
it is scored in a 1-token decode step (target-only decoding) or as one of the K+1 rows of a verify call.
Kernels may not promise that: a GEMM can pick another blocking (and so another order of float sums) for
M > 1 rows than for M = 1, and a quantized kernel that quantizes its activations may do so per call.
`verify_consistency` measures it directly: the same greedy continuation is fed once token by token and
once in chunks of K+1, and the logits of every position are compared.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from specpipe.engines.base import Engine


@dataclass(frozen=True)
class Consistency:
    max_abs_logit_diff: float  # largest |decode - verify| over every position and vocabulary entry
    argmax_flips: int  # positions whose argmax differs between the two ways of scoring
    positions: int  # positions compared
    chunk: int  # tokens per multi-token call (K + 1)

    @property
    def exact(self) -> bool:
        return self.max_abs_logit_diff == 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "exact": self.exact}


def verify_consistency(engine: Engine, prompts: Sequence[Sequence[int]], *, new_tokens: int = 32, chunk: int = 5) -> Consistency:
    """Compare 1-token decode logits with `chunk`-token call logits on the greedy continuation of each prompt.

    Both runs prefill the prompt in one call (as decoding does), so only the generated positions differ
    in how they are scored. Example, chunk 3: decode scores positions p, p+1, p+2, ... one call each;
    the other run scores [p, p+1, p+2] in one call, then [p+3, p+4, p+5], ...
    """
    worst, flips, compared = 0.0, 0, 0
    for prompt in prompts:
        prompt = [int(t) for t in prompt]
        budget = min(new_tokens, engine.max_seq_len - len(prompt) - 1)
        decode = engine.new_sequence()
        last = decode.append(prompt)[-1]
        tokens, decode_rows = [], []
        for _ in range(budget):
            tokens.append(int(last.argmax()))
            last = decode.append(tokens[-1:])[-1]
            decode_rows.append(last)
        chunked = engine.new_sequence()
        chunked.append(prompt)
        chunk_rows = [row for start in range(0, len(tokens), chunk) for row in chunked.append(tokens[start : start + chunk])]
        if not tokens:
            continue
        a, b = np.stack(decode_rows), np.stack(chunk_rows)  # [budget, V] each
        worst = max(worst, float(np.abs(a - b).max()))
        flips += int((a.argmax(-1) != b.argmax(-1)).sum())
        compared += len(tokens)
    return Consistency(worst, flips, compared, chunk)


def batch_consistency(engine: Engine, prompts: Sequence[Sequence[int]], *, new_tokens: int = 24) -> Consistency:
    """Compare each prompt's lone 1-token decode logits with the same steps run batched, one call for all prompts'
    rows (what a batching server runs): whether a request's output depends on the requests beside it.

    Each prompt is decoded greedily alone; then all are prefilled into one batch and fed the same tokens, one
    batched step per position. `chunk` is 1 (one token per row per call). Example, 2 prompts: alone, [a1], [a2],
    ... and [b1], [b2], ...; batched, [a1 | b1], [a2 | b2], ...
    """
    prompts = [[int(t) for t in prompt] for prompt in prompts]
    budget = min(new_tokens, min(engine.max_seq_len - len(p) - 1 for p in prompts))
    alone_tokens, alone_rows = [], []
    for prompt in prompts:
        sequence = engine.new_sequence()
        last = sequence.append(prompt)[-1]
        tokens, rows = [], []
        for _ in range(budget):
            tokens.append(int(last.argmax()))
            last = sequence.append(tokens[-1:])[-1]
            rows.append(last)
        alone_tokens.append(tokens)
        alone_rows.append(np.stack(rows) if rows else np.zeros((0, engine.vocab_size), np.float32))
    batch = engine.new_batch(len(prompts))
    sequences = [batch.new_sequence() for _ in prompts]
    for sequence, prompt in zip(sequences, prompts):
        sequence.append(prompt)
    steps = [batch.decode(sequences, [tokens[i] for tokens in alone_tokens]) for i in range(budget)]  # [rows, V] each
    batched = np.stack(steps, axis=1) if steps else np.zeros((len(prompts), 0, engine.vocab_size), np.float32)
    a = np.stack(alone_rows)  # [prompts, budget, V]
    worst = float(np.abs(a - batched).max()) if budget else 0.0
    flips = int((a.argmax(-1) != batched.argmax(-1)).sum())
    return Consistency(worst, flips, len(prompts) * budget, 1)
