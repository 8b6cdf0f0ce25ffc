"""ONNX Runtime engine for graphs with GroupQueryAttention over a shared KV buffer.

onnxruntime-genai's model builder (export/ortgenai_builder.py) emits this graph for Llama-family models: inputs
input_ids [batch, n] and attention_mask [batch, total]; past_key_values.{i}.key/value [batch, kv_heads,
capacity, head_dim] and present.{i}.* bound to the same memory, so a step writes only its new keys and values
in place. GroupQueryAttention reads each row's length from its mask (seqlens_k = sum(mask) - 1) and applies
rotary positions itself, so rows of different lengths run in one call, and a rollback is a length change:
nothing is copied (the concat graph copies the whole cache every step and expands it per query head).

One limit decides the design (ONNX Runtime 1.32, CPU): a call with more than one row AND more than one new
token per row is refused ("batch_size must be 1 when sequence_length > 1 and past context is given"). So
`KVBatch.decode` runs one new token for every row in one call (batched decoding), and a row's multi-token
call (prefill chunk, speculative verify) runs alone on that row's slice of the buffer, in place. The one
exception is rows' first prompts: with nothing cached, each row's mask marks its own prompt length within
the longest one (right padding), and `KVBatch.prefill` runs new requests' whole prompts in one call
(GroupQueryAttention's first-prompt path: the logits at each row's last position are those of the row alone,
measured bit-identical here; tests/test_batching.py).

Rows live in slots 0..n-1 of one buffer [max_rows, kv_heads, capacity, head_dim]: a batched call takes the
first n slots as one contiguous view; releasing a row moves the last row into its slot (one row's copy).
Writes past a row's length are harmless: no query attends beyond its own position, and the next write there
overwrites them. That is what lets a batched call carry rows that have nothing to run (a dummy token).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from specpipe.engines.base import (
    ENGINE_META,
    Engine,
    EngineBatch,
    EngineSequence,
    Preempted,
    Preemption,
    meta_token_ids,
    read_engine_meta,
)
from specpipe.engines.huge_pages import huge_pages_for_new_memory
from specpipe.errors import EngineError
from specpipe.export.features import FEATURE_OUTPUT
from specpipe.export.logit_positions import LOGITS_INDEX

MODEL_FILE = "model.onnx"
KV_LAYOUT = "shared"  # engine.json's `kv_layout` for this graph; absent means the concat graph (onnxruntime.py)
_MIN_CAPACITY = 256  # tokens; the buffer doubles from here as rows grow


def _kv_names(inputs: Sequence[str]) -> tuple[list[str], list[str]]:
    past = [n for n in inputs if n.startswith("past_key_values.")]
    past.sort(key=lambda n: (int(n.split(".")[1]), n.endswith(".value")))
    return past, [n.replace("past_key_values.", "present.") for n in past]


class SharedKVEngine(Engine):
    def __init__(self, folder: str | Path, *, threads: int = 2, min_rows: int = 1, spinning: bool = True):
        import onnxruntime as ort

        from specpipe.engines.onnxruntime import session_options

        self.folder = Path(folder)
        self.min_rows = min_rows  # a lone row's shorter calls are padded to this many tokens (onnxruntime.py)
        self.meta = read_engine_meta(self.folder)
        model_path = self.folder / MODEL_FILE
        if not model_path.is_file():
            raise EngineError(f"{self.folder} has no {MODEL_FILE}")
        try:
            with huge_pages_for_new_memory() as self.huge_pages:  # the weights ONNX Runtime loads (huge_pages.py)
                self.session = ort.InferenceSession(str(model_path), session_options(threads, spinning=spinning),
                                                    providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
            raise EngineError(f"cannot load {model_path}: {str(exc).splitlines()[0]}") from None
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.past_names, self.present_names = _kv_names(list(inputs))
        if not self.past_names or "attention_mask" not in inputs or "position_ids" in inputs:
            raise EngineError(f"{model_path} is not a shared-KV GroupQueryAttention graph (engine.json says "
                              f"kv_layout {KV_LAYOUT!r})")
        first = inputs[self.past_names[0]]
        # The graph names the head dimension symbolically ('kv_cache_dim'); engine.json records it.
        self.kv_heads, self.head_dim = int(self.meta["num_kv_heads"]), int(self.meta["head_dim"])
        self.kv_dtype = np.float16 if first.type == "tensor(float16)" else np.float32
        self.vocab_size = int(self.meta["vocab_size"])
        self.token_ids = meta_token_ids(self.meta)
        self.max_seq_len = int(self.meta.get("max_seq_len", 2048))
        # Layer-output ids whose residual stream the graph also outputs (export/features.py); () when exported without.
        outputs = {o.name for o in self.session.get_outputs()}
        self.feature_layers = tuple(int(i) for i in self.meta.get("feature_layers") or ()) if FEATURE_OUTPUT in outputs else ()
        # Whether the graph computes logits only at the positions a call asks for (export/logit_positions.py); an
        # engine exported before that computes them everywhere and run_outputs slices.
        self.selects_logits = LOGITS_INDEX in inputs

    def new_sequence(self) -> EngineSequence:
        """A sequence with a buffer of its own (a one-row batch)."""
        return KVBatch(self, max_rows=1).new_sequence()

    def new_batch(self, max_rows: int) -> "KVBatch":
        return KVBatch(self, max_rows)

    def bind(self, buffers: list[np.ndarray], extra_outputs: Sequence[str] = ()) -> "KVBinding":
        """An IOBinding with the KV inputs and outputs bound in place to `buffers` (per KV input, [rows, kv_heads,
        capacity, head_dim]), for calls that output logits and `extra_outputs`. Kept and reused while the buffers
        live: binding 60 KV arrays costs ~0.4 ms a call in Python, ~1.4% of a SmolLM2-135M step (KVBatch._binding)."""
        import onnxruntime as ort

        binding = self.session.io_binding()
        for past, present, buffer in zip(self.past_names, self.present_names, buffers):
            value = ort.OrtValue.ortvalue_from_numpy(buffer)  # wraps the memory: no copy
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        return KVBinding(self, binding, ("logits", *extra_outputs))

    def run(self, buffers: "list[np.ndarray] | KVBinding", input_ids: np.ndarray, lengths: np.ndarray,
            preempt: Optional[Preemption] = None, new_lengths: Optional[np.ndarray] = None,
            logits_at: Optional[np.ndarray] = None) -> np.ndarray:
        """Logits [rows, m, vocab] of one session call (see `run_outputs`)."""
        return self.run_outputs(buffers, input_ids, lengths, preempt, new_lengths, logits_at=logits_at)[0]

    def run_with_features(self, buffers: "list[np.ndarray] | KVBinding", input_ids: np.ndarray, lengths: np.ndarray,
                          preempt: Optional[Preemption] = None, new_lengths: Optional[np.ndarray] = None,
                          logits_at: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
        """(logits [rows, m, vocab], features [rows, n, hidden * len(feature_layers)]) of one session call, on an
        engine exported with feature layers (export/features.py; engine.json `feature_layers`)."""
        if not self.feature_layers:
            raise EngineError(f"{self.folder} was exported without feature outputs (no {FEATURE_OUTPUT!r})")
        logits, features = self.run_outputs(buffers, input_ids, lengths, preempt, new_lengths,
                                            extra_outputs=(FEATURE_OUTPUT,), logits_at=logits_at)
        return logits, features

    def run_outputs(self, buffers: "list[np.ndarray] | KVBinding", input_ids: np.ndarray, lengths: np.ndarray,
                    preempt: Optional[Preemption] = None, new_lengths: Optional[np.ndarray] = None,
                    extra_outputs: Sequence[str] = (), logits_at: Optional[np.ndarray] = None) -> list[np.ndarray]:
        """One session call. `buffers`: per KV input, [rows, kv_heads, capacity, head_dim] (written in place), or a
        `bind`ing of them kept from an earlier call (its outputs must be `extra_outputs`); input_ids [rows, n];
        lengths [rows]: each row's cached tokens before the call; new_lengths [rows]: the tokens of each row's
        input that are real (right padding; default all n); logits_at [rows, m]: the positions (within each row's
        n new tokens) whose logits are wanted, default all n (a prompt's call wants its last one: the graph then
        skips the LM head elsewhere, export/logit_positions.py). Returns [logits [rows, m, vocab], *extra_outputs]; an
        output of the graph not asked for is not bound (SmolLM2 with features bound or not: the same decode time as
        without them, measured 0.97-0.98x in alternating runs). Through a kept binding the arrays returned are its
        output buffers, which the binding's next call overwrites: copy what you keep.
        `preempt`: another thread may stop the call (ONNX Runtime's RunOptions.terminate, checked before each
        node: it returns within a node's time); then this raises `Preempted`. What the stopped call wrote lies
        past each row's length, where nothing reads it (module docstring)."""
        kv = buffers if isinstance(buffers, KVBinding) else self.bind(buffers, extra_outputs)
        if kv.output_names[1:] != tuple(extra_outputs):
            raise ValueError(f"this binding outputs {kv.output_names}, not logits + {tuple(extra_outputs)}")
        rows, new = input_ids.shape
        totals = lengths + (new if new_lengths is None else new_lengths)
        if logits_at is not None and (logits_at.dtype != np.int64 or logits_at.ndim != 2):
            logits_at = np.ascontiguousarray(logits_at, dtype=np.int64).reshape(rows, -1)
        kv.bind_inputs(input_ids, totals, (logits_at if logits_at is not None else _all_positions(rows, new))
                       if self.selects_logits else None)
        return self._run_bound(kv, rows, new, logits_at, preempt)

    def _run_bound(self, kv: "KVBinding", rows: int, new: int, logits_at: Optional[np.ndarray],
                   preempt: Optional[Preemption]) -> list[np.ndarray]:
        """`run_outputs` once the inputs are bound: bind the outputs, run, slice an older graph's logits."""
        picked = new if logits_at is None or not self.selects_logits else logits_at.shape[1]
        outputs = kv.bind_outputs(rows, new, picked)
        try:
            if preempt is None:
                self.session.run_with_iobinding(kv.binding)
            else:
                import onnxruntime as ort

                run_options = ort.RunOptions()
                with preempt.running(lambda: setattr(run_options, "terminate", True)):
                    try:
                        self.session.run_with_iobinding(kv.binding, run_options)
                    except Exception:  # onnxruntime's RuntimeError "Exiting due to terminate flag being set to true"
                        if preempt.requested:
                            raise Preempted() from None
                        raise
        finally:
            kv.let_go()
        if self.selects_logits or logits_at is None:
            return outputs
        return [outputs[0][np.arange(rows)[:, None], logits_at], *outputs[1:]]  # an older graph: sliced here


@functools.lru_cache(maxsize=256)
def _all_positions(rows: int, new: int) -> np.ndarray:
    """[rows, new]: every position's logits (read-only: KVBinding.bind_inputs keeps it bound while it is passed)."""
    positions = np.tile(np.arange(new, dtype=np.int64), (rows, 1))
    positions.flags.writeable = False
    return positions


@functools.lru_cache(maxsize=256)
def _last_positions(new: int, last: int) -> np.ndarray:
    """[1, last]: the last `last` of a one-row call's `new` positions (read-only, as `_all_positions`)."""
    positions = np.arange(new - last, new, dtype=np.int64)[None, :]
    positions.flags.writeable = False
    return positions


# Calls of at most this many new tokens a row (decode steps, speculative verification up to K = 16) write their
# outputs into buffers the binding keeps; longer ones (prompts: [1, 256, 49152] floats is 50 MB) into new arrays.
_KEPT_OUTPUT_TOKENS = 17


class KVBinding:
    """`SharedKVEngine.bind`'s result: an IOBinding whose KV arrays are bound in place once, and the output arrays
    ONNX Runtime writes into: the leading part of one buffer per output, kept for the next calls (no allocation, no
    copy out of ONNX Runtime's memory)."""

    def __init__(self, engine: SharedKVEngine, binding, output_names: tuple[str, ...]):
        self.engine, self.binding, self.output_names = engine, binding, output_names
        outputs = {o.name: o for o in engine.session.get_outputs()}
        self.widths = [int(outputs[name].shape[-1]) for name in output_names]  # vocab, hidden * layers
        self.dtypes = [np.float16 if outputs[name].type == "tensor(float16)" else np.float32 for name in output_names]
        self._kept: list[np.ndarray] = [np.empty((0, w), d) for w, d in zip(self.widths, self.dtypes)]  # [tokens, width]
        self._bound: tuple[tuple[int, int, int], list[np.ndarray]] = ((0, 0, 0), [])
        self._ids: dict[tuple[int, int], np.ndarray] = {}  # [rows, new] -> the token ids array bound for that shape
        self._ids_bound: tuple[int, int] = (0, 0)  # the shape of the one bound now; (0, 0): a prompt's array
        self._ones = np.ones(0, np.int64)  # all-ones masks are views of this
        self._index_bound: Optional[np.ndarray] = None  # the read-only logits index bound now

    def bind_inputs(self, input_ids: np.ndarray, totals: np.ndarray, logits_index: Optional[np.ndarray]) -> None:
        """Bind a call's inputs: token ids [rows, n], the attention mask of rows holding `totals` tokens after it,
        and the logits index [rows, m] (None: a graph without one). What stays the same from call to call stays
        bound: a decode or verify call's token ids are written into an array bound once per shape, a read-only
        index array (_all_positions, _last_positions) is bound once, and when every row reaches the longest total
        (one row always) the mask is a view of kept ones. Per decode step that leaves one binding, the mask's
        (its width grows), where building and binding all three cost 0.15-0.25 ms of a SmolLM2-135M step:
        Python and numpy code running cold, after the step streamed 540 MB of weights through the caches (s38)."""
        rows, new = input_ids.shape
        self._bind_ids(input_ids, rows, new)
        total = int(totals.max())
        if rows == 1 or bool((totals == total).all()):
            mask = self._all_ones(rows, total)
        else:
            mask = (np.arange(total)[None, :] < totals[:, None]).astype(np.int64)  # [rows, total]
        self.binding.bind_cpu_input("attention_mask", mask)
        self._bind_index(logits_index)

    def bind_row(self, token_ids: list[int], total: int, logits_index: Optional[np.ndarray]) -> None:
        """`bind_inputs` for a one-row call from a token list (SlotSequence._forward): the same bindings with less
        numpy around them, which is what a decode step's Python costs here."""
        self._bind_ids(token_ids, 1, len(token_ids))
        self.binding.bind_cpu_input("attention_mask", self._all_ones(1, total))
        self._bind_index(logits_index)

    def _bind_ids(self, token_ids, rows: int, new: int) -> None:
        if new > _KEPT_OUTPUT_TOKENS:  # a prompt: its own array
            self.binding.bind_cpu_input("input_ids", np.array(token_ids, np.int64).reshape(rows, new))
            self._ids_bound = (0, 0)
            return
        ids = self._ids.get((rows, new))
        if ids is None:
            ids = self._ids[(rows, new)] = np.empty((rows, new), np.int64)
        ids[...] = token_ids  # ONNX Runtime reads this memory when the call runs
        if self._ids_bound != (rows, new):
            import onnxruntime as ort

            self.binding.bind_ortvalue_input("input_ids", ort.OrtValue.ortvalue_from_numpy(ids))
            self._ids_bound = (rows, new)

    def _all_ones(self, rows: int, total: int) -> np.ndarray:
        """A [rows, total] mask of ones: a view of kept memory."""
        if len(self._ones) < rows * total:
            self._ones = np.ones(2 * rows * total, np.int64)
        return self._ones[None, :total] if rows == 1 else self._ones[: rows * total].reshape(rows, total)

    def _bind_index(self, logits_index: Optional[np.ndarray]) -> None:
        if logits_index is not None and (logits_index is not self._index_bound or logits_index.flags.writeable):
            self.binding.bind_cpu_input(LOGITS_INDEX, logits_index)
            self._index_bound = logits_index

    def bind_outputs(self, rows: int, new: int, picked: int) -> list[np.ndarray]:
        """The arrays the next call writes its outputs into: logits [rows, picked, vocab], then [rows, new, width]
        for each extra output."""
        import onnxruntime as ort

        if self._bound[0] == (rows, new, picked):
            return self._bound[1]
        tokens = [picked, *[new] * (len(self.widths) - 1)]
        if new <= _KEPT_OUTPUT_TOKENS:
            if any(len(kept) < rows * n for kept, n in zip(self._kept, tokens)):
                self._kept = [np.empty((rows * max(new, picked), w), d) for w, d in zip(self.widths, self.dtypes)]
            arrays = [kept[: rows * n].reshape(rows, n, -1) for kept, n in zip(self._kept, tokens)]  # contiguous views
        else:
            arrays = [np.empty((rows, n, w), d) for n, w, d in zip(tokens, self.widths, self.dtypes)]
        for name, array in zip(self.output_names, arrays):
            self.binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(array))
        self._bound = ((rows, new, picked), arrays) if new <= _KEPT_OUTPUT_TOKENS else ((0, 0, 0), [])
        return arrays

    def let_go(self) -> None:
        """After a call into new arrays (a prompt's), stop holding them: the binding holds what it binds, and 16 rows'
        64-token prompts left 200 MB of logits alive (measured: a 16-row batch's peak 1413 MiB against 1220 before
        bindings were kept). The next call binds its outputs anew."""
        import onnxruntime as ort

        if not self._bound[1]:
            for name, width, dtype in zip(self.output_names, self.widths, self.dtypes):
                self.binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(np.empty((1, 1, width), dtype)))


class KVBatch(EngineBatch):
    """Up to `max_rows` sequences in one shared buffer (module docstring)."""

    def __init__(self, engine: SharedKVEngine, max_rows: int):
        if max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        self.engine, self.max_rows = engine, max_rows
        self.rows: list[SlotSequence] = []  # rows[i] lives in slot i
        self.capacity = 0
        self.buffers: list[np.ndarray] = []
        self._bindings: dict[tuple[int, int, bool], KVBinding] = {}
        self._grow(_MIN_CAPACITY)

    def new_sequence(self) -> "SlotSequence":
        if len(self.rows) >= self.max_rows:
            raise EngineError(f"the batch is full ({self.max_rows} rows)")
        row = SlotSequence(self, len(self.rows))
        self.rows.append(row)
        return row

    def release(self, row: EngineSequence) -> None:
        slot = self.rows.index(row)
        last = self.rows.pop()
        if last is not row:  # keep slots 0..n-1 contiguous: the last row moves into the freed slot
            for buffer in self.buffers:
                buffer[slot, :, : len(last)] = buffer[last.slot, :, : len(last)]
            last.slot = slot
            self.rows[slot] = last
        row.slot = -1

    def decode(self, rows: Sequence[EngineSequence], token_ids: Sequence[int],
               preempt: Optional[Preemption] = None) -> np.ndarray:
        """Append one token to each of `rows` in one call. Returns logits [len(rows), vocab]. `preempt`: the
        call may be stopped (`Preempted`, rows unchanged); a lone row's call is not, as `append` writes it."""
        if len(rows) != len(token_ids):
            raise ValueError(f"{len(rows)} rows but {len(token_ids)} tokens")
        if not rows:
            return np.zeros((0, self.engine.vocab_size), np.float32)
        if len(rows) == 1:
            return rows[0].append([token_ids[0]])
        if any(row.batch is not self or row.slot < 0 for row in rows):
            raise EngineError("decode() got a row of another batch")
        n = 1 + max(row.slot for row in rows)  # slots 0..n-1 run; those not in `rows` carry a dummy token 0
        ids = np.zeros((n, 1), np.int64)
        lengths = np.array([len(r) for r in self.rows[:n]], np.int64)
        for row, token in zip(rows, token_ids):
            ids[row.slot, 0] = int(token)
        self._reserve(int(lengths.max()) + 1)
        if any(row.features is not None for row in rows):  # a row whose drafter reads features (EAGLE-3)
            logits, features = self.engine.run_with_features(self._binding(0, n, True), ids, lengths, preempt)
            for row in rows:
                if row.features is not None:
                    row.features = features[row.slot, :1].copy()
        else:
            logits = self.engine.run(self._binding(0, n, False), ids, lengths, preempt)
        for row, token in zip(rows, token_ids):  # only now: a stopped call leaves every row as it was
            row.tokens.append(int(token))
        return logits[[row.slot for row in rows], 0]

    def prefill(self, rows: Sequence[EngineSequence], prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """Append each row's whole prompt, rows with nothing cached yet: logits [len(rows), vocab] at each
        prompt's last position. Rows in consecutive slots run in one call (module docstring)."""
        if len(rows) != len(prompts) or any(not p for p in prompts):
            raise ValueError("prefill() needs one non-empty prompt per row")
        if any(row.batch is not self or row.slot < 0 or len(row) for row in rows):
            raise EngineError("prefill() takes rows of this batch with nothing cached")
        if len(rows) == 1:
            return rows[0].append(prompts[0], last=1)  # alone: the padded single-row path (min_rows)
        order = sorted(range(len(rows)), key=lambda i: rows[i].slot)
        runs, logits = [[order[0]]], np.zeros((len(rows), self.engine.vocab_size), np.float32)
        for i in order[1:]:  # consecutive slots, one call each (new rows usually are: they are added last)
            if rows[i].slot == rows[runs[-1][-1]].slot + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            sizes = np.array([len(prompts[i]) for i in run], np.int64)
            ids = np.zeros((len(run), int(sizes.max())), np.int64)
            for j, i in enumerate(run):  # right padding repeats the last token; nothing reads those positions
                ids[j] = list(prompts[i]) + [prompts[i][-1]] * (ids.shape[1] - sizes[j])
            self._reserve(ids.shape[1])
            first = rows[run[0]].slot
            lengths = np.zeros(len(run), np.int64)
            if any(rows[i].features is not None for i in run):  # a row whose drafter reads features (EAGLE-3)
                kv = self._binding(first, len(run), True)
                out, features = self.engine.run_with_features(kv, ids, lengths, new_lengths=sizes,
                                                              logits_at=sizes[:, None] - 1)
                for j, i in enumerate(run):
                    if rows[i].features is not None:
                        rows[i].features = features[j, : sizes[j]].copy()
            else:
                out = self.engine.run(self._binding(first, len(run), False), ids, lengths, new_lengths=sizes,
                                      logits_at=sizes[:, None] - 1)
            logits[run] = out[:, 0]
        for row, prompt in zip(rows, prompts):
            row.tokens.extend(int(t) for t in prompt)
        return logits

    def _binding(self, first: int, rows: int, features: bool) -> KVBinding:
        """The kept binding of slots first..first+rows-1, with or without the features output (its outputs are
        overwritten by its next call: callers copy what they keep)."""
        key = (first, rows, features)
        if key not in self._bindings:
            views = [b[first : first + rows] for b in self.buffers]  # contiguous: the slot is the outer axis
            self._bindings[key] = self.engine.bind(views, (FEATURE_OUTPUT,) if features else ())
        return self._bindings[key]

    def _reserve(self, length: int) -> None:
        if length > self.engine.max_seq_len:
            raise EngineError(f"sequence of {length} tokens exceeds the engine's {self.engine.max_seq_len}")
        if length > self.capacity:
            self._grow(max(length, 2 * self.capacity))

    def _grow(self, capacity: int) -> None:
        capacity = min(capacity, self.engine.max_seq_len)
        shape = (self.max_rows, self.engine.kv_heads, capacity, self.engine.head_dim)
        # Written now, not zero pages the OS maps on first touch: the server's memory is what it holds from
        # here on, not something that creeps up as new rows are first used.
        grown = [np.full(shape, 0, self.engine.kv_dtype) for _ in self.engine.past_names]
        for old, new in zip(self.buffers, grown):
            new[:, :, : self.capacity] = old
        self.buffers, self.capacity = grown, capacity
        self._bindings = {}  # they hold the old buffers


@dataclass(frozen=True)
class KVPrefix:
    """Tokens and, per KV input, their keys or values [kv_heads, len(tokens), head_dim] (SlotSequence.save_prefix)."""

    tokens: tuple[int, ...]
    kv: list[np.ndarray]


class SlotSequence(EngineSequence):
    """One row of a KVBatch: its keys and values live in slot `slot` of the batch's buffer."""

    def __init__(self, batch: KVBatch, slot: int):
        super().__init__()
        self.batch, self.slot = batch, slot

    selects_logits = True  # _forward computes only the logits asked for (export/logit_positions.py)
    lends = True  # and can return its binding's output buffer (EngineSequence.append_lent)

    def _forward(self, token_ids: list[int], last: Optional[int] = None, *, lend: bool = False) -> np.ndarray:
        if self.slot < 0:
            raise EngineError("this row was released")
        batch, past_len, new_len = self.batch, len(self.tokens), len(token_ids)
        # Padding repeats the last token; it is written past the row's end, where nothing reads it.
        pad = max(0, min(batch.engine.min_rows - new_len, batch.engine.max_seq_len - past_len - new_len))
        batch._reserve(past_len + new_len + pad)
        at = _last_positions(new_len, min(last or new_len, new_len))  # [1, m]: the logits wanted
        engine, features = batch.engine, self.features is not None
        kv = batch._binding(self.slot, 1, features)
        kv.bind_row(token_ids + token_ids[-1:] * pad, past_len + new_len + pad, at if engine.selects_logits else None)
        outputs = engine._run_bound(kv, 1, new_len + pad, at, None)
        if features:
            self.features = outputs[1][0, :new_len].copy()
        return outputs[0][0] if lend else outputs[0][0].copy()  # lent: the binding's buffer, its next call's output

    def save_prefix(self, length: int) -> "KVPrefix":
        """A copy of this row's first `length` cached tokens and their keys and values, for rows that start with
        the same tokens (`load_prefix`): their calls then run only what follows it."""
        if not 0 < length <= len(self.tokens):
            raise ValueError(f"cannot save a {length}-token prefix of a {len(self.tokens)}-token row")
        return KVPrefix(tuple(self.tokens[:length]),
                        [buffer[self.slot, :, :length].copy() for buffer in self.batch.buffers])

    def load_prefix(self, prefix: "KVPrefix") -> None:
        """Start this empty row with `prefix` cached, as if its tokens had been appended (a copy of the keys and
        values; positions are a row's token count, so nothing else changes)."""
        if self.slot < 0:
            raise EngineError("this row was released")
        if len(self.tokens):
            raise EngineError("load_prefix() takes a row with nothing cached")
        if len(prefix.kv) != len(self.batch.buffers):
            raise EngineError("the prefix was saved from another engine")
        self.batch._reserve(len(prefix.tokens))
        for buffer, kv in zip(self.batch.buffers, prefix.kv):
            buffer[self.slot, :, : len(prefix.tokens)] = kv
        self.tokens.extend(prefix.tokens)

    def keep_features(self) -> None:
        if not self.batch.engine.feature_layers:
            raise EngineError(f"{self.batch.engine.folder} was exported without feature outputs")
        self.features = np.zeros((0, 0), np.float32)  # not None: the next call binds the features output

    def _truncate_cache(self, length: int) -> None:
        pass  # the buffer keeps stale entries past `length`; the next write overwrites them


def is_shared_kv(folder: Path) -> bool:
    return read_engine_meta(folder).get("kv_layout") == KV_LAYOUT


__all__ = ["ENGINE_META", "KVBatch", "KVBinding", "KVPrefix", "SharedKVEngine", "SlotSequence", "is_shared_kv"]
