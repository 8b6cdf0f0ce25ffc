"""ONNX Runtime engine: the embedded CPU default.

The graph is the one optimum exports for `text-generation-with-past`: inputs input_ids, attention_mask,
position_ids and past_key_values.{i}.key/value [batch, kv_heads, past_len, head_dim]; outputs logits
[batch, n, vocab] and present.{i}.key/value. One call takes any number of new tokens on top of the cache.
Rollback is a slice of the cached arrays along the sequence axis.

`min_rows`: ONNX Runtime's CPU kernels (MLAS) run a 1-row MatMul or MatMulNBits through other code than a
multi-row one (a GEMV; for MatMulNBits with int8 activations, accuracy_level 4, onnxruntime/core/mlas/lib/
sqnbitgemm_kernel_avx2.cpp dispatches M=1 to its own `sqnbitgemm_m1_*` kernels), and the two round
differently: SmolLM2-135M's logits moved by up to 7e-5 in fp32 and by 1.4-1.8 as int4-wo / int8-wo on an
AVX2 CPU (docs/decoding.md "Greedy equivalence"). A speculative verify call always has K+1 >= 2 rows, so a target opened with min_rows=2 runs its
1-token steps as 2-row calls (the token twice; the extra row's logits and cache entries are dropped): every
call then goes through the same kernels, and a position's logits are the same alone and inside a verify
call (measured bit-identical, engines/consistency.py; docs/decoding.md "Greedy equivalence"). Only a target that
verifies is opened so (builder/measure.py `rows_per_call`): a batched 1-token step takes the 1-token path too, so
without a draft an unpadded target's lone steps equal its batched ones, and padded they do not. (A lone MatMulNBits
node gave 1-row and 8-row results equal to ~1e-6 on Zen 4, exact at blocks of 16 and 32: the 1-token path of
the attention, amplified by int8 activations, is the likelier source of the difference.)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specpipe.engines.base import ENGINE_META, Engine, EngineSequence, meta_token_ids, read_engine_meta
from specpipe.errors import EngineError

MODEL_FILE = "model.onnx"

_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
TARGET_MIN_ROWS = 2  # what `build` records for a target (module docstring); drafts run unpadded


def session_options(threads: int, *, optimize: bool = True, spinning: bool = True):
    """`spinning` False: worker threads block as soon as they run out of work inside a call, instead of spinning.
    A server turns it off: its process also runs the response threads, and the machine its clients (docs/batching.md,
    "Where the time goes": 16 streams 1.3-1.8x faster with it off on a loaded 2-core machine)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    so.log_severity_level = 3
    # Worker threads spin for a while after each run by default. A speculative step alternates two
    # sessions (draft, target) on the same cores, and each one's spinning threads starve the other: on this
    # 2-core machine 4 draft steps + a 5-token verification took 60 ms spinning vs 31 ms stopped, with
    # single-session steps unchanged (docs/benchmarks.md, "Measured").
    so.add_session_config_entry("session.force_spinning_stop", "1")
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


class OrtEngine(Engine):
    def __init__(self, folder: str | Path, *, threads: int = 2, min_rows: int = 1, spinning: bool = True):
        import onnxruntime as ort

        self.folder = Path(folder)
        self.min_rows = min_rows  # rows per session run; shorter calls are padded (module docstring)
        self.meta = read_engine_meta(self.folder)
        model_path = self.folder / MODEL_FILE
        if not model_path.is_file():
            raise EngineError(f"{self.folder} has no {MODEL_FILE}")
        try:
            # Graphs saved already optimized by `optimize_for_cpu` skip the optimizer at load time.
            so = session_options(threads, optimize=not self.meta.get("ort_optimized", False), spinning=spinning)
            self.session = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
            raise EngineError(f"cannot load {model_path}: {str(exc).splitlines()[0]}") from None
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = [o.name for o in self.session.get_outputs()]
        self.past_names = sorted((n for n in inputs if n.startswith("past_key_values.")), key=_kv_order)
        self.present_names = [n.replace("past_key_values.", "present.") for n in self.past_names]
        if "logits" not in outputs or any(p not in outputs for p in self.present_names) or not self.past_names:
            raise EngineError(f"{model_path} is not a text-generation-with-past graph (inputs {sorted(inputs)[:4]}...)")
        first = inputs[self.past_names[0]]
        self.kv_dtype = _ORT_DTYPES.get(first.type, np.float32)
        self.kv_shape = (1, int(first.shape[1]), 0, int(first.shape[3]))  # [batch, kv_heads, 0, head_dim]
        self.output_names = ["logits", *self.present_names]
        self.uses_position_ids = "position_ids" in inputs
        self.vocab_size = int(self.meta["vocab_size"])
        self.token_ids = meta_token_ids(self.meta)
        self.max_seq_len = int(self.meta.get("max_seq_len", 2048))

    def new_sequence(self) -> "OrtSequence":
        return OrtSequence(self)


def _kv_order(name: str) -> tuple[int, int]:
    _, layer, kind = name.split(".")  # past_key_values.{i}.key|value
    return int(layer), 0 if kind == "key" else 1


class OrtSequence(EngineSequence):
    def __init__(self, engine: OrtEngine):
        super().__init__()
        self.engine = engine
        self.kv = [np.zeros(engine.kv_shape, engine.kv_dtype) for _ in engine.past_names]

    def _forward(self, token_ids: list[int]) -> np.ndarray:
        past_len, new_len = len(self.tokens), len(token_ids)
        if past_len + new_len > self.engine.max_seq_len:
            raise EngineError(f"sequence of {past_len + new_len} tokens exceeds the engine's {self.engine.max_seq_len}")
        pad = max(0, min(self.engine.min_rows - new_len, self.engine.max_seq_len - past_len - new_len))
        rows = token_ids + token_ids[-1:] * pad  # the padding repeats the last token; causal: no row sees it
        feed = {
            "input_ids": np.asarray([rows], dtype=np.int64),
            "attention_mask": np.ones((1, past_len + len(rows)), dtype=np.int64),
            **dict(zip(self.engine.past_names, self.kv)),
        }
        if self.engine.uses_position_ids:
            feed["position_ids"] = np.arange(past_len, past_len + len(rows), dtype=np.int64)[None, :]
        logits, *self.kv = self.engine.session.run(self.engine.output_names, feed)
        if pad:
            self._truncate_cache(past_len + new_len)
        return logits[0, :new_len]  # [new_len, vocab]

    def _truncate_cache(self, length: int) -> None:
        self.kv = [np.ascontiguousarray(x[:, :, :length]) for x in self.kv]


def optimize_for_cpu(src: Path, dst_dir: Path, *, threads: int = 2) -> Path:
    """Run ONNX Runtime's graph optimizer once and save the result as the engine artifact.

    ORT_ENABLE_EXTENDED is the highest level whose result can be saved (ENABLE_ALL adds layout
    transforms that are applied at load time only). Large models keep their weights in an external file.
    """
    import onnxruntime as ort

    dst_dir.mkdir(parents=True, exist_ok=True)
    so = session_options(threads)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(dst_dir / MODEL_FILE)
    weights_bytes = sum(p.stat().st_size for p in src.parent.iterdir() if p.is_file())
    if weights_bytes > 1.8e9:  # protobuf's 2 GB limit
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", MODEL_FILE + ".data")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    return dst_dir / MODEL_FILE


def write_engine_meta(folder: Path, **meta) -> None:
    (Path(folder) / ENGINE_META).write_text(json.dumps({"backend": "onnxruntime", **meta}, indent=2) + "\n")
