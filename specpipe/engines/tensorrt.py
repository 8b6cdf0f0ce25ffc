"""TensorRT engine: a `model.plan` built from optimum's text-generation-with-past graph, KV cache on the GPU.

The plan has three optimization profiles (prefill, decode, verify; specpipe/engines/tensorrt_build.py); each
has its own execution context, so switching call shapes never re-selects a profile. A sequence keeps its
cache as one CUDA tensor per past_key_values input, [1, kv_heads, past, head_dim]; a call feeds it and the
graph's present.* outputs (the cache with the new tokens appended) become the next cache. Rollback is a
slice along the sequence axis, as in the ONNX Runtime engine. Device memory comes from torch (CUDA
build), which also gives the stream handle; tensorrt and torch are imported when an engine is opened.

TensorRT API names: specpipe/engines/upstream.py. Requirements of IExecutionContext.set_tensor_address
(NVIDIA/TensorRT include/NvInferRuntime.h): every input needs a non-null address with 256-byte alignment,
even an empty one, so a cache of length 0 is fed a small placeholder buffer.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from specpipe.engines.base import Engine, EngineSequence, meta_token_ids, read_engine_meta
from specpipe.errors import EngineError


class TensorRTEngine(Engine):
    def __init__(self, folder: str | Path, *, device: int = 0):
        try:
            import tensorrt as trt
            import torch
        except ImportError as exc:
            raise EngineError(f"the tensorrt engine in {folder} needs the tensorrt package and a CUDA build of torch: {exc}") from None
        if not torch.cuda.is_available():
            raise EngineError(f"the tensorrt engine in {folder} needs a CUDA GPU (torch.cuda.is_available() is False)")
        from specpipe.engines.tensorrt_build import Profile

        self.folder = Path(folder)
        self.meta = read_engine_meta(self.folder)
        plan_path = self.folder / self.meta.get("plan", "model.plan")
        if not plan_path.is_file():
            raise EngineError(f"{self.folder} has no {plan_path.name}")
        self.torch = torch
        self.device = torch.device("cuda", device)
        self.vocab_size = int(self.meta["vocab_size"])
        self.token_ids = meta_token_ids(self.meta)
        self.max_seq_len = int(self.meta["max_seq_len"])
        self.profiles = [Profile.model_validate(p) for p in self.meta["profiles"]]
        self._lock = threading.Lock()  # execution contexts are not thread-safe; sequences may be

        self._logger = trt.Logger(trt.Logger.WARNING)
        with torch.cuda.device(self.device):
            self.engine = trt.Runtime(self._logger).deserialize_cuda_engine(plan_path.read_bytes())
            if self.engine is None:
                raise EngineError(f"TensorRT could not load {plan_path} (built for another TensorRT version or GPU?)")
            if self.engine.num_optimization_profiles != len(self.profiles):
                raise EngineError(f"{plan_path} has {self.engine.num_optimization_profiles} profiles, engine.json lists {len(self.profiles)}")
            self.stream = torch.cuda.Stream(self.device)
            self.contexts = []
            for index in range(len(self.profiles)):
                context = self.engine.create_execution_context()
                context.set_optimization_profile_async(index, self.stream.cuda_stream)
                self.contexts.append(context)
            self.stream.synchronize()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.past_names = sorted((n for n in self.inputs if n.startswith("past_key_values.")), key=_kv_order)
        self.present_names = [n.replace("past_key_values.", "present.") for n in self.past_names]
        if "logits" not in self.outputs or any(p not in self.outputs for p in self.present_names) or not self.past_names:
            raise EngineError(f"{plan_path} is not a text-generation-with-past engine (inputs {self.inputs[:4]}...)")
        self.dtypes = {n: _torch_dtype(torch, trt, self.engine.get_tensor_dtype(n)) for n in names}
        self.kv_heads = int(self.meta["num_kv_heads"])
        self.head_dim = int(self.meta["head_dim"])
        # the placeholder address for a zero-length cache (torch's allocator aligns to 512 bytes)
        self._placeholder = torch.zeros(256, dtype=torch.uint8, device=self.device)

    def new_sequence(self) -> "TensorRTSequence":
        return TensorRTSequence(self)

    def _select(self, new_tokens: int, past_tokens: int) -> int:
        from specpipe.engines.tensorrt_build import select_profile

        return select_profile(self.profiles, new_tokens, past_tokens)


def _kv_order(name: str) -> tuple[int, int]:
    _, layer, kind = name.split(".")  # past_key_values.{i}.key|value
    return int(layer), 0 if kind == "key" else 1


def _torch_dtype(torch, trt, dtype):
    table = {
        trt.float32: torch.float32,
        trt.float16: torch.float16,
        trt.bfloat16: torch.bfloat16,
        trt.int64: torch.int64,
        trt.int32: torch.int32,
        trt.int8: torch.int8,
        trt.bool: torch.bool,
    }
    if dtype not in table:
        raise EngineError(f"engine I/O type {dtype} is not supported by specpipe's TensorRT engine")
    return table[dtype]


class TensorRTSequence(EngineSequence):
    def __init__(self, engine: TensorRTEngine):
        super().__init__()
        self.engine = engine
        torch = engine.torch
        self.kv = [
            torch.empty((1, engine.kv_heads, 0, engine.head_dim), dtype=engine.dtypes[name], device=engine.device)
            for name in engine.past_names
        ]

    def _forward(self, token_ids: list[int]) -> np.ndarray:
        engine = self.engine
        past_len, new_len = len(self.tokens), len(token_ids)
        if past_len + new_len > engine.max_seq_len:
            raise EngineError(f"sequence of {past_len + new_len} tokens exceeds the engine's {engine.max_seq_len}")
        prefill_max = engine.profiles[0].new_tokens.max
        if new_len <= prefill_max:
            return self._run(token_ids, past_len)
        logits = []  # a prompt longer than the prefill profile: feed it in chunks
        try:
            for start in range(0, new_len, prefill_max):
                logits.append(self._run(token_ids[start : start + prefill_max], past_len + start))
        except Exception:
            self._truncate_cache(past_len)
            raise
        return np.concatenate(logits)

    def _run(self, token_ids: list[int], past_len: int) -> np.ndarray:
        engine, torch = self.engine, self.engine.torch
        new_len = len(token_ids)
        total = past_len + new_len
        feeds = {
            "input_ids": torch.tensor([token_ids], dtype=engine.dtypes["input_ids"], device=engine.device),
            "attention_mask": torch.ones((1, total), dtype=engine.dtypes["attention_mask"], device=engine.device),
            **dict(zip(engine.past_names, self.kv)),
        }
        if "position_ids" in engine.inputs:
            feeds["position_ids"] = torch.arange(past_len, total, dtype=engine.dtypes["position_ids"], device=engine.device)[None, :]
        with engine._lock, torch.cuda.device(engine.device):
            context = engine.contexts[engine._select(new_len, past_len)]
            for name, tensor in feeds.items():
                context.set_input_shape(name, tuple(tensor.shape))
                address = tensor.data_ptr() if tensor.numel() else engine._placeholder.data_ptr()
                context.set_tensor_address(name, address)
            outputs = {}
            for name in engine.outputs:
                shape = tuple(context.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise EngineError(f"TensorRT left output {name} with an unknown shape {shape}")
                outputs[name] = torch.empty(shape, dtype=engine.dtypes[name], device=engine.device)
                context.set_tensor_address(name, outputs[name].data_ptr() if outputs[name].numel() else engine._placeholder.data_ptr())
            # inputs were written on torch's current stream; the engine runs on its own
            engine.stream.wait_stream(torch.cuda.current_stream(engine.device))
            if not context.execute_async_v3(engine.stream.cuda_stream):
                raise EngineError("TensorRT execute_async_v3 failed")
            engine.stream.synchronize()
        self.kv = [outputs[name] for name in engine.present_names]
        return outputs["logits"][0].float().cpu().numpy()  # [new_len, vocab]

    def _truncate_cache(self, length: int) -> None:
        self.kv = [x[:, :, :length].contiguous() for x in self.kv]
