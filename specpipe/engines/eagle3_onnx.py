"""An EAGLE-3 head as an ONNX Runtime graph: the computation of engines/eagle3_head.py, one session call a step.

Why: the torch head runs ~40 eager ops a step, and on a 2-core CPU their dispatch costs more than the head's
matrices (SmolLM2-135M's head: ~1 ms a step in torch int8, 0.15 of an int8-wo target step; docs/eagle3-decoding.md
measures both). One ONNX Runtime call runs the same ops from one graph. The graph is built here from the head's
tensors with onnx.helper when the head is opened (no file to write or keep in step with the checkpoint), and
its matrices are quantized with the target's own weight-only recipe (drafts/eagle3.py `open_head`, the quantize stage
being later than this one) when int8 runs faster here (drafts/eagle3.py `fastest_head_dtype` times both).

One call appends r = n + m rows to the head's cache (the caller's numpy arrays) and returns the last row's logits:

    inputs   features   [n, F]       the target's f_i of n context rows (n = 0 for a draft step)
             state      [m, H]       the previous call's state g (m = 1 for a draft step, 0 for context rows)
             embeds     [r, H]       E[t] of the rows' tokens (the target's input embedding, gathered by the caller)
             past_key   [T, kv, d]   the cached rows, position = index (T = the cache's length)
             past_value [T, kv, d]
    outputs  logits     [1, Vd]      the last row's draft-vocabulary logits
             next_state [1, H]       the last row's state, the next draft step's `state`
             new_key    [r, kv, d]   the r rows' keys (RoPE applied) and values, for the caller's cache
             new_value  [r, kv, d]

Rows are [fc(features); state]: a call is either context rows or one draft step, never both.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from specpipe.engines.eagle3_head import PositionCache
from specpipe.errors import EngineError

_MIN_CAPACITY = 256  # positions; the cache doubles from here
_OPSET = 22
_DOMAINS = (("", _OPSET), ("com.microsoft", 1))  # SimplifiedLayerNormalization is ONNX Runtime's RMSNorm
# The head's matrices [out, in] by upstream name, as the graph's initializers (transposed: MatMul takes [in, out]).
MATRICES = ("fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
             "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
             "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "lm_head.weight")
_NORMS = ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
          "midlayer.post_attention_layernorm.weight", "norm.weight")


def head_graph(spec):
    """The head's step as an onnx ModelProto with fp32 matrices. `spec`: an eagle3_head.Eagle3Head."""
    return build_graph({name: spec.w[name].numpy() for name in MATRICES + _NORMS}, heads=spec.heads,
                       kv_heads=spec.kv_heads, head_dim=spec.head_dim, eps=spec.eps, rope_theta=spec.rope_theta)


def build_graph(tensors: dict, *, heads: int, kv_heads: int, head_dim: int, eps: float, rope_theta: float):
    """`head_graph` from its parts. `tensors`: name -> numpy array, upstream's names."""
    from onnx import TensorProto, helper, numpy_helper

    hidden_size = tensors["fc.weight"].shape[0]
    group = heads // kv_heads
    nodes, inits = [], []

    def const(name, array):
        inits.append(numpy_helper.from_array(np.array(array, order="C"), name))  # ascontiguousarray makes 0-d 1-d
        return name

    def node(op, inputs, outputs=None, domain="", **attrs):
        outputs = outputs or [f"{op}_{len(nodes)}"]
        nodes.append(helper.make_node(op, inputs, outputs, name=f"{op}_{len(nodes)}", domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def matmul(x, name):
        return node("MatMul", [x, const(name, tensors[name].astype(np.float32).T)])

    def rms_norm(x, name):
        return node("SimplifiedLayerNormalization", [x, const(name, tensors[name].astype(np.float32))],
                    epsilon=eps, axis=-1, stash_type=1)

    def shape(*dims):
        return const(f"shape_{len(inits)}", np.array(dims, np.int64))

    def rope(x, cos, sin):  # x [r, h, d]; rotate-half, as HF Llama and training
        halves = [f"first_half_{len(nodes)}", f"second_half_{len(nodes)}"]
        first, second = node("Split", [x, shape(head_dim // 2, head_dim // 2)], halves, axis=-1)
        rotated = node("Concat", [node("Neg", [second]), first], axis=-1)
        return node("Add", [node("Mul", [x, cos]), node("Mul", [rotated, sin])])

    # The rows: fc(features) of the context rows, then the carried state of a draft step.
    hidden = node("Concat", [matmul("features", "fc.weight"), "state"], axis=0)  # [r, H]
    x = node("Concat", [rms_norm("embeds", "midlayer.input_layernorm.weight"),
                        rms_norm(hidden, "midlayer.hidden_norm.weight")], axis=-1)  # [r, 2H]

    # Positions T .. T + r - 1 (T: the cached rows) and their rotary angles.
    past_len = node("Gather", [node("Shape", ["past_key"]), const("zero", np.array(0, np.int64))], axis=0)
    rows = node("Gather", [node("Shape", ["embeds"]), "zero"], axis=0)
    total = node("Add", [past_len, rows])
    positions = node("Range", [past_len, total, const("one", np.array(1, np.int64))])  # [r]
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    angles = node("Mul", [node("Unsqueeze", [node("Cast", [positions], to=TensorProto.FLOAT), shape(1)]),
                          const("inv_freq", inv_freq.astype(np.float32)[None])])  # [r, d/2]
    angles = node("Unsqueeze", [node("Concat", [angles, angles], axis=-1), shape(1)])  # [r, 1, d]
    cos, sin = node("Cos", [angles]), node("Sin", [angles])

    q = rope(node("Reshape", [matmul(x, "midlayer.self_attn.q_proj.weight"), shape(-1, heads, head_dim)]), cos, sin)
    k = rope(node("Reshape", [matmul(x, "midlayer.self_attn.k_proj.weight"), shape(-1, kv_heads, head_dim)]), cos, sin)
    v = node("Reshape", [matmul(x, "midlayer.self_attn.v_proj.weight"), shape(-1, kv_heads, head_dim)])
    node("Identity", [k], ["new_key"])
    node("Identity", [v], ["new_value"])
    keys = node("Transpose", [node("Concat", ["past_key", k], axis=0)], perm=[1, 2, 0])  # [kv, d, T + r]
    values = node("Transpose", [node("Concat", ["past_value", v], axis=0)], perm=[1, 0, 2])  # [kv, T + r, d]

    # Attention, grouped: head h reads kv head h // group; query rows ordered (row, head in group).
    q = node("Reshape", [node("Transpose", [node("Reshape", [q, shape(-1, kv_heads, group, head_dim)])],
                                 perm=[1, 0, 2, 3]), shape(kv_heads, -1, head_dim)])  # [kv, r * group, d]
    scores = node("Mul", [node("MatMul", [q, keys]), const("scale", np.array(1 / math.sqrt(head_dim), np.float32))])  # [kv, r * group, T + r]
    # No causal mask: only the last row's output is read (below), and the last row sees every position.
    attended = node("MatMul", [node("Softmax", [scores], axis=-1), values])  # [kv, r * group, d]
    attended = node("Reshape", [node("Transpose", [node("Reshape", [attended, shape(kv_heads, -1, group, head_dim)])],
                                     perm=[1, 0, 2, 3]), shape(-1, heads * head_dim)])  # [r, heads * d]
    residual = node("Add", [hidden, matmul(attended, "midlayer.self_attn.o_proj.weight")])

    # Only the last row's state is read: the MLP and the head run on it alone.
    last = node("Slice", [residual, shape(-1), shape(np.iinfo(np.int64).max), shape(0)])  # [1, H]
    normed = rms_norm(last, "midlayer.post_attention_layernorm.weight")
    gate = matmul(normed, "midlayer.mlp.gate_proj.weight")
    mlp = node("Mul", [node("Mul", [gate, node("Sigmoid", [gate])]), matmul(normed, "midlayer.mlp.up_proj.weight")])
    node("Add", [last, matmul(mlp, "midlayer.mlp.down_proj.weight")], ["next_state"])
    node("MatMul", [rms_norm("next_state", "norm.weight"), const("lm_head.weight", tensors["lm_head.weight"].astype(np.float32).T)],
         ["logits"])

    draft_vocab = tensors["lm_head.weight"].shape[0]
    feature_width = tensors["fc.weight"].shape[1]
    f32 = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "eagle3_head",
        [helper.make_tensor_value_info("features", f32, ["n", feature_width]),
         helper.make_tensor_value_info("state", f32, ["m", hidden_size]),
         helper.make_tensor_value_info("embeds", f32, ["r", hidden_size]),
         helper.make_tensor_value_info("past_key", f32, ["T", kv_heads, head_dim]),
         helper.make_tensor_value_info("past_value", f32, ["T", kv_heads, head_dim])],
        [helper.make_tensor_value_info("logits", f32, [1, draft_vocab]),
         helper.make_tensor_value_info("next_state", f32, [1, hidden_size]),
         helper.make_tensor_value_info("new_key", f32, ["r", kv_heads, head_dim]),
         helper.make_tensor_value_info("new_value", f32, ["r", kv_heads, head_dim])],
        inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in _DOMAINS])


def open_session(model, *, threads: int = 1):
    """An ONNX Runtime CPU session over `model` (a ModelProto, serialized in memory). One thread by default: the
    head runs between target calls, and a 2-thread step waits on the other thread (eagle3_head._one_thread)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
        raise EngineError(f"ONNX Runtime cannot run the head's graph: {str(exc).splitlines()[0]}") from None


class Eagle3OnnxHead:
    """The head (`eagle3_head.Eagle3Head`'s config, tensors and draft vocabulary) run by ONNX Runtime over `model`,
    `head_graph`'s graph of it, its matrices as given (fp32, or int8 MatMulNBits from the quantize stage:
    drafts/eagle3.py `open_head` makes both). `dtype` names it in HEAD_DTYPES. Same calls as
    eagle3_head.Eagle3HeadEngine: new_cache, context_rows, draft_step."""

    def __init__(self, spec, model, *, dtype: str):
        self.spec = spec
        for name in ("folder", "feature_layers", "feature_width", "draft_vocab_size", "token_ids",
                     "target_vocab_size", "hidden_size", "kv_heads", "head_dim", "max_seq_len"):
            setattr(self, name, getattr(spec, name))
        self.dtype = dtype
        self.session = open_session(model)
        self.embedding = spec.embedding_array
        self._no_features = np.zeros((0, self.feature_width), np.float32)
        self._no_state = np.zeros((0, self.hidden_size), np.float32)

    def new_cache(self) -> "OnnxHeadCache":
        return OnnxHeadCache(self)

    def context_rows(self, cache: "OnnxHeadCache", token_ids: Sequence[int], features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append n context rows: token_ids [n] (t_{i+1} of row i), features [n, F] (the target's f_i). Returns the
        last row's logits [draft_vocab_size] and state [1, H], the next draft step's input."""
        if features.shape != (len(token_ids), self.feature_width):
            raise ValueError(f"features {features.shape} for {len(token_ids)} rows of width {self.feature_width}")
        return self._run(cache, token_ids, np.ascontiguousarray(features, dtype=np.float32), self._no_state)

    def draft_step(self, cache: "OnnxHeadCache", token_id: int, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append one draft position: the token drafted last, on the previous call's state [1, H]."""
        return self._run(cache, [token_id], self._no_features, state)

    def _run(self, cache: "OnnxHeadCache", token_ids: Sequence[int], features: np.ndarray, state: np.ndarray):
        rows = len(token_ids)
        if len(cache) + rows > self.max_seq_len:
            raise EngineError(f"the head's cache would hold {len(cache) + rows} positions, beyond its {self.max_seq_len}")
        past_key, past_value = cache.cached()
        logits, next_state, new_key, new_value = self.session.run(None, {
            "features": features, "state": state, "embeds": self.embedding[np.asarray(token_ids, np.int64)],
            "past_key": past_key, "past_value": past_value})
        cache.append(new_key, new_value)
        return logits[0], next_state


class OnnxHeadCache(PositionCache):
    """The head's keys and values, position-major: [capacity, kv_heads, head_dim], `length` used, so the cached
    rows are one contiguous slice the session reads in place."""

    def __init__(self, head: Eagle3OnnxHead):
        self.length = 0
        self.keys = np.zeros((_MIN_CAPACITY, head.kv_heads, head.head_dim), np.float32)
        self.values = np.zeros_like(self.keys)

    def cached(self) -> tuple[np.ndarray, np.ndarray]:
        return self.keys[: self.length], self.values[: self.length]

    def append(self, keys: np.ndarray, values: np.ndarray) -> None:
        """keys, values [n, kv_heads, d]."""
        end = self.length + len(keys)
        if end > len(self.keys):
            capacity = max(end, 2 * len(self.keys))
            self.keys = np.concatenate([self.keys, np.zeros((capacity - len(self.keys), *self.keys.shape[1:]), np.float32)])
            self.values = np.concatenate([self.values, np.zeros_like(self.keys[len(self.values):])])
        self.keys[self.length : end], self.values[self.length : end] = keys, values
        self.length = end
