"""GPU memory per rank for a draft/target plan: weights, KV cache, and a stated reserve.

An estimate from arithmetic, not a measurement (nothing here has run on a GPU). The rules, each one a
line below:
- GB means 1e9 bytes.
- Linear layers take the bytes per weight of their quantization; int4 adds one fp16 scale per group
  of 128 weights (AWQ's default block, quantize.py --awq_block_size 128).
- Embedding and lm_head stay in the model dtype (2 bytes): ModelOpt's configs leave `*lm_head*`
  unquantized and an embedding is a lookup, not a GEMM.
- Tensor parallelism splits the layers and the lm_head (TensorRT-LLM shards lm_head by vocabulary); the
  embedding is replicated on every rank (convert_checkpoint.py's default, --use_parallel_embedding off).
- KV cache per token per rank: 2 (K and V) x layers x KV heads on the rank x head_dim x bytes. With more
  ranks than KV heads, each rank keeps one (TensorRT-LLM replicates KV heads).
- The KV cache is sized for max_batch_size sequences of max_seq_len tokens, for target and draft.
- Every model instance on a GPU reserves RESERVE_GB for the CUDA context, GEMM workspaces and
  activations. A round number to be replaced by a measurement on real hardware.
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from specpipe.checkpoint.facts import ModelShape

GB = 1e9
RESERVE_GB = 2.0
MODEL_DTYPE_BYTES = 2  # float16 / bfloat16
INT4_GROUP = 128

# Bytes per weight of a linear layer, by specpipe quant mode.
LINEAR_BYTES = {
    "none": float(MODEL_DTYPE_BYTES),
    "fp8": 1.0,
    "int8": 1.0,
    "int8-wo": 1.0,
    "int4-wo": 0.5 + MODEL_DTYPE_BYTES / INT4_GROUP,
}
KV_BYTES = {"auto": MODEL_DTYPE_BYTES, "fp8": 1, "int8": 1}


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelMemory(_Frozen):
    """One model split over `tp` ranks; the numbers are for one rank."""

    role: str
    tp: int
    weights_total_gb: float = Field(description="all ranks together")
    weights_gb: float = Field(description="per rank")
    kv_bytes_per_token: int = Field(description="per rank")
    kv_tokens: int
    kv_cache_gb: float = Field(description="per rank")
    reserve_gb: float = RESERVE_GB


class RankMemory(_Frozen):
    gpu: int
    models: tuple[str, ...]
    weights_gb: float
    kv_cache_gb: float
    reserve_gb: float

    @property
    def total_gb(self) -> float:
        return self.weights_gb + self.kv_cache_gb + self.reserve_gb


class MemoryPlan(_Frozen):
    target: ModelMemory
    draft: Optional[ModelMemory]  # None: drafting needs no model (n-gram lookup)
    gpus: tuple[RankMemory, ...]
    gpu_memory_gb: Optional[float] = None

    @property
    def peak_gb(self) -> float:
        return max(gpu.total_gb for gpu in self.gpus)

    @property
    def fits(self) -> Optional[bool]:
        return None if self.gpu_memory_gb is None else self.peak_gb <= self.gpu_memory_gb


def weights_bytes(
    shape: ModelShape, quant: str, tp: int, *, separate_lm_head: bool = True, dtype_bytes: int = MODEL_DTYPE_BYTES
) -> tuple[float, float]:
    """(all ranks, one rank) bytes of weights. `separate_lm_head`: the engine holds lm_head as its own
    tensor even when the checkpoint ties it (TensorRT-LLM checkpoints always do). `dtype_bytes`: bytes of
    what is not quantized (4 for a Q/DQ graph TensorRT builds as it is)."""
    embedding = shape.embedding_params
    has_head = separate_lm_head or not shape.tie_word_embeddings
    head = embedding if has_head else 0
    in_checkpoint_head = 0 if shape.tie_word_embeddings else embedding
    body = shape.params - embedding - in_checkpoint_head  # linear layers and norms
    linear = dtype_bytes if quant == "none" else LINEAR_BYTES[quant]
    total = body * linear + (embedding + head) * dtype_bytes
    per_rank = body * linear / tp + head * dtype_bytes / tp + embedding * dtype_bytes
    return total, per_rank


def kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    return max(1, shape.kv_heads // tp)


def kv_bytes_per_token(shape: ModelShape, kv_cache_dtype: str, tp: int, *, dtype_bytes: int = MODEL_DTYPE_BYTES) -> int:
    element = dtype_bytes if kv_cache_dtype == "auto" else KV_BYTES[kv_cache_dtype]
    return 2 * shape.layers * kv_heads_per_rank(shape, tp) * shape.head_dim * element


def model_memory(
    role: str,
    shape: ModelShape,
    *,
    quant: str,
    kv_cache_dtype: str,
    tp: int,
    kv_tokens: int,
    separate_lm_head: bool = True,
    dtype_bytes: int = MODEL_DTYPE_BYTES,
) -> ModelMemory:
    total, per_rank = weights_bytes(shape, quant, tp, separate_lm_head=separate_lm_head, dtype_bytes=dtype_bytes)
    per_token = kv_bytes_per_token(shape, kv_cache_dtype, tp, dtype_bytes=dtype_bytes)
    return ModelMemory(
        role=role, tp=tp, weights_total_gb=total / GB, weights_gb=per_rank / GB,
        kv_bytes_per_token=per_token, kv_tokens=kv_tokens, kv_cache_gb=per_token * kv_tokens / GB,
    )  # fmt: skip


def place(target: ModelMemory, draft: Optional[ModelMemory], *, shared: bool, gpu_memory_gb: Optional[float]) -> MemoryPlan:
    """Target ranks on GPUs 0..tp-1; the draft on GPU 0.. (shared) or on the GPUs after the target's."""
    gpus: dict[int, list[ModelMemory]] = {i: [target] for i in range(target.tp)}
    first_draft_gpu = 0 if shared else target.tp
    for i in range(draft.tp if draft is not None else 0):
        gpus.setdefault(first_draft_gpu + i, []).append(draft)
    ranks = tuple(
        RankMemory(
            gpu=gpu,
            models=tuple(f"{m.role}[rank {gpu - (0 if m is target else first_draft_gpu)}/{m.tp}]" for m in models),
            weights_gb=sum(m.weights_gb for m in models),
            kv_cache_gb=sum(m.kv_cache_gb for m in models),
            reserve_gb=sum(m.reserve_gb for m in models),
        )
        for gpu, models in sorted(gpus.items())
    )
    return MemoryPlan(target=target, draft=draft, gpus=ranks, gpu_memory_gb=gpu_memory_gb)


def valid_tp(shape: ModelShape, tp: int) -> Optional[str]:
    """None if `shape` splits over `tp` ranks, else why not."""
    if shape.heads % tp:
        return f"{shape.heads} attention heads do not split over {tp} GPUs"
    if shape.kv_heads % tp and tp % shape.kv_heads:
        return f"{shape.kv_heads} KV heads neither split over nor replicate onto {tp} GPUs"
    return None
