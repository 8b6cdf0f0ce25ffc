"""The Engine interface: one loaded model, many independent sequences, each with its own KV cache.

An `EngineSequence` holds the token ids whose keys and values are cached. `append(ids)` runs the model
on any number of new tokens on top of the cache and returns logits for every new position (that is how
K drafted tokens are verified in one call); `truncate(n)` rolls the cache back to its first n tokens.
Sequences of one engine may run in different threads at once.
"""

from __future__ import annotations

import json
import threading
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from specpipe.errors import EngineError

ENGINE_META = "engine.json"


class EngineSequence(ABC):
    """Token ids with a KV cache. Subclasses implement `_forward` and `_truncate_cache`."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        # After keep_features(): [new tokens, F] the target features of the last call's positions (EAGLE-3 heads).
        self.features: Optional[np.ndarray] = None

    def keep_features(self) -> None:
        """From now on every call also keeps its positions' target features in `features` (an engine exported
        with feature layers, export/features.py). Without this call no call computes them."""
        raise EngineError(f"{type(self).__name__} outputs no target features")

    def __len__(self) -> int:
        return len(self.tokens)

    # Whether _forward takes `last` and computes only those logits (export/logit_positions.py); else append slices.
    selects_logits = False
    # Whether _forward takes `lend` and may then return its own output buffer instead of a copy (append_lent).
    lends = False

    def append(self, token_ids: Sequence[int], last: Optional[int] = None) -> np.ndarray:
        """Run the model on `token_ids` after the cache. Returns logits, float32 [len(token_ids), vocab], or with
        `last` those of the last `last` positions only: a prompt's call wants one, and an engine that can skips the
        LM head on the rest (19-20% of a SmolLM2-135M prompt's call, docs/benchmarks.md)."""
        return self._append(token_ids, last, lend=False)

    def append_lent(self, token_ids: Sequence[int], last: Optional[int] = None) -> np.ndarray:
        """`append` for a caller that is done with the logits before its next call on this engine: they may be the
        engine's own output buffer, which that call overwrites (SlotSequence: a decode step's logits are read once,
        by the verdict, and copying them out first cost 0.05-0.07 ms of a SmolLM2-135M step, s38)."""
        return self._append(token_ids, last, lend=True)

    def _append(self, token_ids: Sequence[int], last: Optional[int], lend: bool) -> np.ndarray:
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            raise ValueError("append() needs at least one token")
        if last is not None and last < 1:
            raise ValueError(f"append() cannot return the last {last} positions' logits")
        if self.lends:
            logits = self._forward(token_ids, last, lend=lend)
        else:
            logits = self._forward(token_ids, last) if self.selects_logits else self._forward(token_ids)
        self.tokens.extend(token_ids)
        return logits if last is None or self.selects_logits else logits[-last:]

    def truncate(self, length: int) -> None:
        """Keep the first `length` cached tokens (rollback after a rejected draft)."""
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"cannot truncate a {len(self.tokens)}-token cache to {length}")
        if length < len(self.tokens):
            self._truncate_cache(length)
            del self.tokens[length:]

    def sync(self, context: Sequence[int], last: Optional[int] = None) -> np.ndarray:
        """Make the cache hold exactly `context`, reusing the longest cached prefix.

        Returns the logits of the positions that had to be (re)computed (with `last`, of at most the last `last`
        of them), the last of which predicts the token after `context`. At least the last token is always
        recomputed so there is a logit to return.
        """
        return self.append(self.rewind_to(context), last)

    def rewind_to(self, context: Sequence[int]) -> list[int]:
        """`sync`'s first half: truncate the cache to the longest prefix it shares with `context` (never all of
        it) and return the tokens still to append (at least one). A batch of rows can then append them together."""
        keep = 0
        for cached, wanted in zip(self.tokens, context):
            if cached != wanted:
                break
            keep += 1
        keep = min(keep, len(context) - 1)
        self.truncate(keep)
        return [int(t) for t in context[keep:]]

    @abstractmethod
    def _forward(self, token_ids: list[int]) -> np.ndarray: ...

    @abstractmethod
    def _truncate_cache(self, length: int) -> None: ...


class Preempted(Exception):
    """A preemptible call was stopped before it finished; its rows are as they were before it."""


class Preemption:
    """Lets another thread stop a running call that its caller marked preemptible (speculative/batching.py: a
    new request stops a batched decode so that its prompt runs first).

    The engine arms it around the call with a way to stop that call (`running(stop)`); `request()` stops the
    call if one is armed and less than `window_s` has passed since it started (later, finishing costs the
    waiter less than what stopping would throw away). A request while nothing is armed is kept (`pending`)
    and stops the next call as it starts, unless the caller `clear()`s it first (it has seen the newcomer).
    An engine that cannot stop a call never arms it. `clock` (seconds) is injectable so that tests state the
    window rule without racing real time.
    """

    def __init__(self, window_s: float = 0.0, clock: Callable[[], float] = time.perf_counter):
        self.window_s, self.clock = window_s, clock
        self.requested = False  # the armed call was asked to stop
        self.pending = False  # asked while nothing was armed
        self._lock = threading.Lock()
        self._stop: Optional[Callable[[], None]] = None
        self._until = 0.0

    @contextmanager
    def running(self, stop: Callable[[], None]) -> Iterator[None]:
        with self._lock:
            self._stop, self._until, self.requested = stop, self.clock() + self.window_s, self.pending
            self.pending = False
            if self.requested:
                stop()
        try:
            yield
        finally:
            with self._lock:
                self._stop = None

    def request(self) -> bool:
        """Stop the armed call, if any and if still early enough, or the next one. True when a call was asked."""
        with self._lock:
            if self._stop is None:
                self.pending = True
                return False
            if self.requested or self.clock() > self._until:
                return False
            self.requested = True
            self._stop()
            return True

    def clear(self) -> None:
        with self._lock:
            self.pending = False


class EngineBatch:
    """Sequences of one engine whose one-token steps run together (continuous batching).

    `decode(rows, tokens)` appends one token to each row; rows still run multi-token calls (a prompt, a
    speculative verify) through their own `append`. This default runs each row on its own; engines whose
    graph can batch rows (engines/shared_kv.py) override it with one call for all rows.
    """

    def __init__(self, engine: "Engine", max_rows: int):
        self.engine, self.max_rows = engine, max_rows
        self.rows: list[EngineSequence] = []

    def new_sequence(self) -> EngineSequence:
        if len(self.rows) >= self.max_rows:
            raise EngineError(f"the batch is full ({self.max_rows} rows)")
        row = self.engine.new_sequence()
        self.rows.append(row)
        return row

    def release(self, row: EngineSequence) -> None:
        self.rows.remove(row)

    def decode(self, rows: Sequence[EngineSequence], token_ids: Sequence[int],
               preempt: Optional[Preemption] = None) -> np.ndarray:
        """Logits [len(rows), vocab] of each row after its token. `preempt`: the call may be stopped (raises
        `Preempted`, rows unchanged); this default runs rows one by one and is never stopped."""
        if len(rows) != len(token_ids):
            raise ValueError(f"{len(rows)} rows but {len(token_ids)} tokens")
        if not rows:
            return np.zeros((0, self.engine.vocab_size), np.float32)
        return np.stack([row.append([token])[-1] for row, token in zip(rows, token_ids)])

    def prefill(self, rows: Sequence[EngineSequence], prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """Append each row's whole prompt: logits [len(rows), vocab] at each prompt's last position. This default
        runs rows one by one; engines/shared_kv.py runs them in one call."""
        if len(rows) != len(prompts):
            raise ValueError(f"{len(rows)} rows but {len(prompts)} prompts")
        return np.stack([row.append(prompt, last=1)[-1] for row, prompt in zip(rows, prompts)])


class Engine(ABC):
    """A loaded model. `vocab_size` is the width of its logits.

    `token_ids`: when set, logit column j scores token `token_ids[j]` (a draft whose head covers only
    the tokens its training data uses, see `draft_vocab`); None: column j is token j.
    """

    vocab_size: int
    max_seq_len: int
    token_ids: Optional[np.ndarray] = None

    @abstractmethod
    def new_sequence(self) -> EngineSequence: ...

    def new_batch(self, max_rows: int) -> EngineBatch:
        return EngineBatch(self, max_rows)


def meta_token_ids(meta: dict) -> Optional[np.ndarray]:
    """engine.json's `token_ids` (the tokens a sliced head scores, in column order), or None."""
    ids = meta.get("token_ids")
    if ids is None:
        return None
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1 or len(ids) != int(meta["vocab_size"]):
        raise EngineError(f"engine.json lists {ids.size} token_ids for {meta['vocab_size']} logit columns")
    return ids


def read_engine_meta(folder: Path) -> dict:
    meta_path = Path(folder) / ENGINE_META
    if not meta_path.is_file():
        raise EngineError(f"{folder} is not an engine folder (no {ENGINE_META})")
    try:
        return json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise EngineError(f"{meta_path} is not valid JSON: {exc}") from None
