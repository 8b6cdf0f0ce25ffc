"""Engines with known, exact distributions, for fast tests of the speculative decoder.

`BigramEngine`'s next-token logits depend only on the current token: a fixed [V, V] table. Its p is known
exactly (no numerics to tolerate), a step costs microseconds (20,000 seeded decoding steps take seconds),
and greedy decoding falls into cycles, which is the repetitive text prompt lookup thrives on.
"""

from __future__ import annotations

import numpy as np

from specpipe.engines.base import Engine, EngineSequence


class BigramEngine(Engine):
    """table[t] = logits of the token after token t. Counts calls so tests can see what drafting cost."""

    def __init__(self, table: np.ndarray, max_seq_len: int = 4096):
        table = np.asarray(table, dtype=np.float32)
        if table.ndim != 2 or table.shape[0] != table.shape[1]:
            raise ValueError(f"a bigram table is [V, V], got {table.shape}")
        self.table = table  # [V, V]
        self.vocab_size = table.shape[1]
        self.max_seq_len = max_seq_len
        self.calls = 0  # forward calls
        self.tokens_run = 0  # tokens run through the model, over all calls

    @classmethod
    def random(cls, vocab_size: int, *, seed: int, scale: float = 3.0, **kwargs) -> "BigramEngine":
        """Gaussian logits; larger `scale` gives more peaked (more confident) rows."""
        rng = np.random.default_rng(seed)
        return cls(rng.normal(0.0, scale, size=(vocab_size, vocab_size)), **kwargs)

    def perturbed(self, noise: float, *, seed: int) -> "BigramEngine":
        """A draft correlated with this engine: the same table plus Gaussian noise of std `noise`."""
        rng = np.random.default_rng(seed)
        return BigramEngine(self.table + rng.normal(0.0, noise, size=self.table.shape), max_seq_len=self.max_seq_len)

    def probs(self, token: int, temperature: float = 1.0) -> np.ndarray:
        """Exact next-token distribution after `token` at `temperature` (> 0), float64 [V]."""
        z = self.table[token].astype(np.float64) / temperature
        z = np.exp(z - z.max())
        return z / z.sum()

    def new_sequence(self) -> EngineSequence:
        return _BigramSequence(self)


class _BigramSequence(EngineSequence):
    def __init__(self, engine: BigramEngine):
        super().__init__()
        self.engine = engine

    def _forward(self, token_ids: list[int]) -> np.ndarray:
        self.engine.calls += 1
        self.engine.tokens_run += len(token_ids)
        return self.engine.table[token_ids]

    def _truncate_cache(self, length: int) -> None:
        pass  # the logits depend on the token alone: there is no cache beyond the token ids
