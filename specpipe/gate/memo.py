"""An Engine that remembers the logits of every prefix it has computed.

The distribution check runs the speculative decoder thousands of times from the same few contexts. The
random choices differ, but the prefixes the engines see repeat: the context, then the context plus one of
a few likely tokens, and so on. Remembering logits by prefix makes a sample cost one engine call per
*new* prefix, while the decoder, the drafter and the acceptance rule run unchanged on the engine's own
numbers. Entries are kept least-recently-used within a memory budget. A sequence that keeps target features
(an EAGLE-3 head drafts from them) gets them remembered the same way, by prefix, beside the logits.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from specpipe.engines.base import Engine, EngineSequence


class MemoEngine(Engine):
    """Wraps `engine` (single-threaded use). Logits of prefix t[:i+1] are stored under tuple(t[:i+1]), and, once a
    sequence keeps features, the features of position i too."""

    def __init__(self, engine: Engine, *, max_bytes: int = 1 << 30):
        self.engine = engine
        self.vocab_size = engine.vocab_size
        self.token_ids = engine.token_ids
        self.max_seq_len = engine.max_seq_len
        self.feature_layers = getattr(engine, "feature_layers", ())
        self.max_entries = max(64, max_bytes // (4 * engine.vocab_size))
        self._rows: OrderedDict[tuple[int, ...], np.ndarray] = OrderedDict()
        self._features: dict[tuple[int, ...], np.ndarray] = {}  # [F] per prefix, while its logits are kept
        self._under = engine.new_sequence()  # the one real sequence; its cache follows the last miss
        self.hits = self.misses = 0

    def new_sequence(self) -> EngineSequence:
        return _MemoSequence(self)

    def keep_features(self) -> None:
        if self._under.features is None:
            self._under.keep_features()  # from now on every computed position's features are stored too

    def row(self, prefix: tuple[int, ...], *, features: bool = False) -> np.ndarray | None:
        """The logits of `prefix`'s last position; None when not remembered (or, with `features`, when its
        features are not)."""
        row = self._rows.get(prefix)
        if row is None or (features and prefix not in self._features):
            return None
        self._rows.move_to_end(prefix)
        return row

    def feature_rows(self, tokens: list[int], start: int) -> np.ndarray:
        """Features [len(tokens) - start, F] of positions start.. of `tokens` (all remembered)."""
        return np.stack([self._features[tuple(tokens[: i + 1])] for i in range(start, len(tokens))])

    def compute(self, tokens: list[int], start: int) -> np.ndarray:
        """Logits [len(tokens) - start, V] of positions start.. of `tokens`, reusing the real cache."""
        keep = 0
        for cached, wanted in zip(self._under.tokens, tokens[:start]):
            if cached != wanted:
                break
            keep += 1
        self._under.truncate(keep)
        logits = self._under.append(tokens[keep:])  # [len(tokens) - keep, V]
        features = self._under.features  # [len(tokens) - keep, F] once a sequence keeps features, else None
        for offset, row in enumerate(logits):
            self._store(tuple(tokens[: keep + offset + 1]), row, None if features is None else features[offset])
        return logits[start - keep :]

    def _store(self, prefix: tuple[int, ...], row: np.ndarray, features: np.ndarray | None) -> None:
        self._rows[prefix] = row
        self._rows.move_to_end(prefix)
        if features is not None:
            self._features[prefix] = features
        while len(self._rows) > self.max_entries:
            evicted, _ = self._rows.popitem(last=False)
            self._features.pop(evicted, None)


class _MemoSequence(EngineSequence):
    def __init__(self, memo: MemoEngine):
        super().__init__()
        self.memo = memo

    def keep_features(self) -> None:
        if not self.memo.feature_layers:
            super().keep_features()  # refuses: the engine outputs none
        self.memo.keep_features()
        self.features = np.zeros((0, 0), np.float32)

    def _forward(self, token_ids: list[int]) -> np.ndarray:
        tokens = self.tokens + token_ids
        start = len(self.tokens)
        keeping = self.features is not None
        rows = [self.memo.row(tuple(tokens[: i + 1]), features=keeping) for i in range(start, len(tokens))]
        missing = next((i for i, row in enumerate(rows) if row is None), None)
        if missing is None:
            self.memo.hits += 1
            logits = np.stack(rows)
        else:
            self.memo.misses += 1
            computed = self.memo.compute(tokens, start + missing)
            logits = np.concatenate([np.stack(rows[:missing]), computed]) if missing else computed
        if keeping:
            self.features = self.memo.feature_rows(tokens, start)
        return logits

    def _truncate_cache(self, length: int) -> None:
        pass  # nothing is cached per sequence; the memo holds it all
