"""An EAGLE-3 head (upstream's checkpoint format, checkpoint/eagle3.py) as a CPU engine: torch, fp32, own KV cache.

The head runs the same computation as training (distill/eagle3.py `Eagle3HeadModule.unrolled`; not imported: that
is a later stage) one call at a time over a KV cache whose length is the next row's position:

    context rows (target features f_i known):  hidden = fc(f_i), token t_{i+1}, position i
    draft steps (one further position each):   hidden = the previous step's state g, the token it drafted,
                                               position = previous + 1
    both:  x = [input_layernorm(E[token]) ; hidden_norm(hidden)]        [2H]
           r = hidden + o_proj(attention(x over the cache))              (Llama attention, rotate-half RoPE)
           g = r + mlp(post_attention_layernorm(r))                      the state the next draft step reads
           logits = lm_head(norm(g))                                     [draft_vocab_size]; column d scores
                                                                         target token d + d2t[d]

A draft step's keys sit after the context rows, where training-time test puts a row's own keys of steps 1..k; the
caller truncates them after verification and appends the verified positions as context rows from the target's
features (engines/shared_kv.py `run_with_features`).

Cost (measured, docs/eagle3-decoding.md): a step reads the head's weights once (SmolLM2-135M's head, H 576, draft
vocabulary 8192: 35 MB in fp32 against the target's 540 MB), so its cost is bandwidth, not torch's per-call overhead
(~0.3-0.7 ms). `dtype` "bfloat16" keeps the matrices in bf16 and multiplies in bf16 (norms, RoPE, softmax and the
state stay fp32): on a Zen 4 (AVX512-BF16) the head's matrix-vector products ran ~3.5x faster, on an Intel
Emerald Rapids with AMX 1.6x slower (6.60 against 4.06 ms a step, docs/demo.md session 36), so builds time every
dtype (drafts/eagle3.py `fastest_head_dtype`); "auto" without a measurement picks bf16 where the ISA has it. The q it
drafts from is whatever it computes, so either dtype keeps decoding lossless.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from specpipe.checkpoint.eagle3 import EAGLE3_CONFIG_BLOCK, EAGLE3_LAYER_IDS_KEY, load_eagle3_tensors
from specpipe.errors import EngineError


_MIN_CAPACITY = 256  # positions; the cache doubles from here
_MATRICES = ("fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
             "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
             "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "lm_head.weight")


# What the head can run in; drafts/eagle3.py `fastest_head_dtype` times them. The first three are torch (this module), the "ort-" ones
# ONNX Runtime (engines/eagle3_onnx.py: one graph, so no eager dispatch per op).
HEAD_DTYPES = ("float32", "bfloat16", "int8", "ort-float32", "ort-int8")
ORT_PREFIX = "ort-"


def head_dtype(dtype: str) -> str:
    """"auto" without a measurement (a manifest written before the build timed the head): bfloat16 where the CPU
    multiplies bf16 natively (AVX512-BF16 or AMX-BF16), else float32. Builds record drafts/eagle3.py `fastest_head_dtype`'s choice."""
    if dtype != "auto":
        if dtype not in HEAD_DTYPES:
            raise EngineError(f"an EAGLE-3 head runs in {', '.join(HEAD_DTYPES)}, not {dtype}")
        return dtype
    from specpipe.machine import describe_machine

    isa = describe_machine().isa
    return "bfloat16" if isa.get("avx512_bf16") or isa.get("amx_bf16") else "float32"


class Eagle3Head:
    """What every runtime of the head in `folder` (config.json + model.safetensors) shares: its config, tensors and
    draft vocabulary. `target_embedding` [vocab, H]: the target's input embedding (heads carry none;
    `target_embedding` below reads it from the target's ONNX graph)."""

    def __init__(self, folder: str | Path, target_embedding: np.ndarray, *, feature_layers: Optional[Sequence[int]] = None):
        import torch

        self.folder = Path(folder)
        config = json.loads((self.folder / "config.json").read_text())
        tensors = load_eagle3_tensors(self.folder)
        self.w = {name: (t.float() if t.is_floating_point() else t) for name, t in tensors.items()}
        self.hidden_size = int(config["hidden_size"])
        self.heads, self.kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
        self.head_dim = int(config.get("head_dim") or self.hidden_size // self.heads)
        self.eps = float(config["rms_norm_eps"])
        self.rope_theta = float(config.get("rope_theta", 10000.0))
        self.max_seq_len = int(config.get("max_position_embeddings", 2048))
        # the layers its config names; `feature_layers` for a head that names none (EAGLE-3's defaults)
        named = (config.get(EAGLE3_CONFIG_BLOCK) or {}).get(EAGLE3_LAYER_IDS_KEY) or feature_layers or ()
        self.feature_layers = tuple(int(i) for i in named)
        self.feature_width = self.w["fc.weight"].shape[1]
        self.draft_vocab_size = self.w["lm_head.weight"].shape[0]
        if target_embedding.shape[1] != self.hidden_size:
            raise EngineError(f"{folder}: the target's embedding is {target_embedding.shape[1]} wide, the head {self.hidden_size}")
        self.embedding_array = np.ascontiguousarray(target_embedding, dtype=np.float32)
        d2t = self.w["d2t"].long()
        # token_ids[d]: the target token draft column d scores (upstream's offset form: target = d + d2t[d]).
        self.token_ids = (torch.arange(len(d2t)) + d2t).numpy()
        self.target_vocab_size = int(config.get("vocab_size", target_embedding.shape[0]))
        if self.token_ids.min() < 0 or self.token_ids.max() >= self.target_vocab_size:
            raise EngineError(f"{folder}: d2t maps draft columns outside the target's {self.target_vocab_size} tokens")


class Eagle3HeadEngine(Eagle3Head):
    """The head run by torch, its matrices in `dtype` (float32, bfloat16 or int8)."""

    def __init__(self, folder: str | Path, target_embedding: np.ndarray, *, dtype: str = "float32",
                 feature_layers: Optional[Sequence[int]] = None):
        import torch

        super().__init__(folder, target_embedding, feature_layers=feature_layers)
        self.dtype = head_dtype(dtype)
        if self.dtype.startswith(ORT_PREFIX):
            raise EngineError(f"{dtype} runs in ONNX Runtime: open it with drafts/eagle3.py open_head")
        if self.dtype == "int8":
            self.mat = {name: _int8_linear(self.w[name]) for name in _MATRICES}
        else:
            self.mat = {name: self.w[name].to(getattr(torch, self.dtype)) for name in _MATRICES}  # [out, in]
        self.embedding = torch.from_numpy(self.embedding_array)
        self.inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)

    def new_cache(self) -> "HeadCache":
        return HeadCache(self)

    # ---- one call over n new rows ----
    def context_rows(self, cache: "HeadCache", token_ids: Sequence[int], features: np.ndarray) -> tuple[np.ndarray, "object"]:
        """Append n context rows: token_ids [n] (t_{i+1} of row i), features [n, F] (the target's f_i). Returns the
        last row's logits [draft_vocab_size] and state [H] (a torch tensor, the next draft step's input)."""
        import torch

        if features.shape != (len(token_ids), self.feature_width):
            raise ValueError(f"features {features.shape} for {len(token_ids)} rows of width {self.feature_width}")
        with torch.inference_mode(), _one_thread():
            hidden = self._mm(torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32)), "fc.weight")
            return self._layer(cache, token_ids, hidden)

    def draft_step(self, cache: "HeadCache", token_id: int, state) -> tuple[np.ndarray, "object"]:
        """Append one draft position: the token drafted last, on the previous call's state [H]."""
        import torch

        with torch.inference_mode(), _one_thread():
            return self._layer(cache, [token_id], state[None])

    def _layer(self, cache: "HeadCache", token_ids: Sequence[int], hidden):
        import torch

        mid = "midlayer."
        n, start = len(token_ids), len(cache)
        if start + n > self.max_seq_len:
            raise EngineError(f"the head's cache would hold {start + n} positions, beyond its {self.max_seq_len}")
        embeds = self.embedding[torch.as_tensor(list(token_ids), dtype=torch.long)]  # [n, H]
        x = torch.cat([self._norm(embeds, mid + "input_layernorm.weight"), self._norm(hidden, mid + "hidden_norm.weight")], -1)
        positions = torch.arange(start, start + n, dtype=torch.float32)
        q = self._rope(self._mm(x, mid + "self_attn.q_proj.weight").view(n, self.heads, self.head_dim), positions)
        k = self._rope(self._mm(x, mid + "self_attn.k_proj.weight").view(n, self.kv_heads, self.head_dim), positions)
        v = self._mm(x, mid + "self_attn.v_proj.weight").view(n, self.kv_heads, self.head_dim)
        keys, values = cache.append(k, v)  # [kv_heads, start + n, d]
        group = self.heads // self.kv_heads
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [heads, T, d]
        scores = (q.transpose(0, 1) @ keys.transpose(1, 2)) / math.sqrt(self.head_dim)  # [heads, n, T]
        if n > 1:  # row j (position start + j) sees positions <= start + j
            visible = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
        out = (torch.softmax(scores, -1) @ values).transpose(0, 1).reshape(n, -1)  # [n, heads * d]
        residual = hidden + self._mm(out, mid + "self_attn.o_proj.weight")
        residual = residual[-1]  # only the last row's state is read: the MLP and head run on it alone
        normed = self._norm(residual, mid + "post_attention_layernorm.weight")
        mlp = torch.nn.functional.silu(self._mm(normed, mid + "mlp.gate_proj.weight")) * self._mm(normed, mid + "mlp.up_proj.weight")
        state = residual + self._mm(mlp, mid + "mlp.down_proj.weight")
        logits = self._mm(self._norm(state, "norm.weight"), "lm_head.weight")
        return logits.numpy(), state

    def _mm(self, x, name: str):
        """x [..., in] times the matrix `name` ([out, in], in self.dtype) -> fp32 [..., out]."""
        matrix = self.mat[name]
        if self.dtype == "int8":  # a dynamically quantized Linear: x [rows, in] fp32 in, fp32 out
            return matrix(x.reshape(-1, x.shape[-1]).float()).reshape(*x.shape[:-1], -1)
        return (x.to(matrix.dtype) @ matrix.T).float()

    def _norm(self, x, name: str):
        import torch

        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def _rope(self, x, positions):
        """x [n, heads, d]; rotate-half RoPE at `positions` [n] (HF Llama's convention, as training)."""
        import torch

        angles = positions[:, None] * self.inv_freq  # [n, d/2]
        angles = torch.cat([angles, angles], -1)[:, None, :]  # [n, 1, d]
        half = self.head_dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * angles.cos() + rotated * angles.sin()


def _int8_linear(weight):
    """`weight` [out, in] as torch's dynamically quantized Linear (torch.ao.nn.quantized.dynamic): int8 weights
    per output channel, each call's activations quantized per tensor, int8 products (FBGEMM / oneDNN kernels, VNNI
    where the CPU has it). Measured on the Zen 4 CPU (AVX-512 VNNI, 1 thread, loaded): the head's 8 matrices in
    turn 0.32 ms against 2.1-5.6 ms in bf16 and 6.9 ms in fp32."""
    import warnings

    import torch
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight.float())
    with warnings.catch_warnings():  # torch.ao.quantization warns it will move to torchao; torch 2.13 still has it
        warnings.simplefilter("ignore")
        return quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear: per_channel_dynamic_qconfig},
                                dtype=torch.qint8)[0]


@contextmanager
def _one_thread():
    """Run the head's small matmuls on one torch thread, leaving the process's setting as it was. Measured on the
    2-core CPU under load (docs/eagle3-decoding.md): a 2-thread draft step waits for the other thread far longer
    than it computes (84 vs 7.8 ms median with SmolLM2's head shape, while the target ran beside it)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class PositionCache:
    """What every head runtime's cache shares: `length` positions in use; truncating is a length change."""

    length: int = 0

    def __len__(self) -> int:
        return self.length

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a {self.length}-position head cache to {length}")
        self.length = length  # entries past it are overwritten by the next append


class HeadCache(PositionCache):
    """The head's keys and values, one entry per position: [kv_heads, capacity, head_dim], `length` used."""

    def __init__(self, engine: Eagle3HeadEngine):
        self.engine, self.length, self.capacity = engine, 0, 0
        self.keys = self.values = None
        self._grow(_MIN_CAPACITY)

    def append(self, k, v):
        """k, v [n, kv_heads, d] -> every cached key and value [kv_heads, length, d] (views, no copy)."""
        n = k.shape[0]
        if self.length + n > self.capacity:
            self._grow(max(self.length + n, 2 * self.capacity))
        self.keys[:, self.length : self.length + n] = k.transpose(0, 1)
        self.values[:, self.length : self.length + n] = v.transpose(0, 1)
        self.length += n
        return self.keys[:, : self.length], self.values[:, : self.length]

    def _grow(self, capacity: int) -> None:
        import torch

        e = self.engine
        keys, values = (torch.zeros(e.kv_heads, capacity, e.head_dim) for _ in range(2))
        if self.keys is not None:
            keys[:, : self.length], values[:, : self.length] = self.keys[:, : self.length], self.values[:, : self.length]
        self.keys, self.values, self.capacity = keys, values, capacity


def target_embedding(engine_folder: str | Path) -> np.ndarray:
    """The input embedding [vocab, H] of the target's ONNX graph in `engine_folder`: the initializer its input_ids
    Gather reads, loaded alone. onnxruntime-genai's builder writes model.embed_tokens.weight, or, for tied
    embeddings (SmolLM2), gathers from a Transpose of lm_head.MatMul.weight [H, vocab]."""
    import onnx
    from onnx import numpy_helper

    path = Path(engine_folder) / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    initializers = {init.name: init for init in model.graph.initializer}
    transposed = {node.output[0]: node.input[0] for node in model.graph.node
                  if node.op_type == "Transpose" and node.input[0] in initializers}

    def load(name: str) -> np.ndarray:
        tensor = initializers[name]
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            return numpy_helper.to_array(tensor).astype(np.float32)
        # Read from the data file directly: onnx's own reader refuses a hard-linked file (a "hardlink attack"),
        # and builds and Triton repositories hard-link their engines.
        where = {entry.key: entry.value for entry in tensor.external_data}
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
        count = int(np.prod(tensor.dims))
        data = np.fromfile(path.parent / where["location"], dtype=dtype, count=count, offset=int(where.get("offset", 0)))
        return data.reshape(tuple(tensor.dims)).astype(np.float32)

    for node in model.graph.node:
        if node.op_type != "Gather" or len(node.input) != 2 or node.input[1] != "input_ids":
            continue
        if node.input[0] in initializers:
            return load(node.input[0])
        if node.input[0] in transposed:
            return np.ascontiguousarray(load(transposed[node.input[0]]).T)
    raise EngineError(f"{path}: no plain Gather of input_ids over an initializer (a quantized embedding?): "
                      "the head needs the target's fp32 input embedding")


def check_pairing(head, target_feature_layers: Sequence[int], target_vocab_size: int,
                  target_folder: Optional[Path] = None) -> None:
    """The head (either runtime's engine: torch here, ONNX Runtime in eagle3_onnx.py) reads exactly the layers the
    target engine outputs, over the target's vocabulary."""
    where = f" ({target_folder})" if target_folder else ""
    if tuple(target_feature_layers) != head.feature_layers:
        raise EngineError(f"the head {head.folder} reads target layers {list(head.feature_layers)}; the target engine"
                          f"{where} outputs {list(target_feature_layers) or 'no features'}")
    if head.target_vocab_size != target_vocab_size:
        raise EngineError(f"the head {head.folder} was made for a {head.target_vocab_size}-token vocabulary; the target"
                          f"{where} has {target_vocab_size}")
