"""tensorrtllm_backend's request/response protocol, and how specpipe maps it onto a GenerationConfig.

Tensor names, types, dims and reshapes are copied from tensorrtllm_backend
all_models/inflight_batcher_llm/tensorrt_llm_bls/config.pbtxt (and ensemble/config.pbtxt, which has the
same tensors minus num_draft_tokens/use_draft_logits) at commit c2e65b88d85255be30cf50440a91662abeb497dd
(2025-05-13, the last one before the models moved into TensorRT-LLM's triton_backend/). The BLS model's
multimodal inputs (image_*, video_*) are left out. `random_seed` is the name the same input had up to
commit 071ee5e (v0.17, renamed `seed` later); both are accepted so older clients work too.

The same parser also takes the request tensors of TensorRT-LLM's current Triton backend, the LLM-API model
(NVIDIA/TensorRT-LLM triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt @0a710573: `streaming`,
`sampling_param_*`, `return_finish_reason`, ...), so a client written for it works against the CPU
deployment too. Upstream's llmapi model has max_batch_size 0 (rank-1 tensors) where tensorrt_llm_bls has a
batch dimension, and one Triton model cannot take both ranks: the CPU repository serves each protocol's
shapes from its own model (specpipe.triton.repository.served_model_spec(protocol=...)). Streamed llmapi
responses carry the whole text so far (its model.py sends RequestOutput.outputs[0].text), BLS ones the new text.

Inputs specpipe cannot honour are declared anyway (a TRT-LLM client may send them) and accepted only at
their neutral value (beam_width 1, repetition_penalty 1.0, ...); anything else is refused with a message
that names the input. Pure numpy here: the Triton adapter (model_py/model.py) only moves tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import numpy as np

from specpipe.contract.decoding import DecodingPolicy
from specpipe.errors import UsageError
from specpipe.triton.model_config import TensorSpec

UPSTREAM = "triton-inference-server/tensorrtllm_backend@c2e65b8 all_models/inflight_batcher_llm/tensorrt_llm_bls/config.pbtxt"


def _in(name: str, data_type: str, dims=(1,), *, optional=True, reshape=None, ragged=False) -> TensorSpec:
    return TensorSpec(
        name=name, data_type=data_type, dims=tuple(dims), optional=optional, reshape=reshape, allow_ragged_batch=ragged
    )


def _out(name: str, data_type: str, dims=(1,)) -> TensorSpec:
    return TensorSpec(name=name, data_type=data_type, dims=tuple(dims))


SCALAR = ()  # reshape: { shape: [ ] } upstream

# In upstream order. Only text_input and max_tokens are required, as upstream.
LLM_INPUTS: tuple[TensorSpec, ...] = (
    _in("text_input", "STRING", optional=False),
    _in("decoder_text_input", "STRING"),
    _in("max_tokens", "INT32", optional=False),
    _in("bad_words", "STRING", (-1,)),
    _in("stop_words", "STRING", (-1,)),
    _in("exclude_input_in_output", "BOOL"),
    _in("end_id", "INT32"),
    _in("pad_id", "INT32"),
    _in("top_k", "INT32"),
    _in("top_p", "FP32"),
    _in("temperature", "FP32"),
    _in("length_penalty", "FP32"),
    _in("repetition_penalty", "FP32"),
    _in("min_tokens", "INT32"),
    _in("presence_penalty", "FP32"),
    _in("frequency_penalty", "FP32"),
    _in("seed", "UINT64"),
    _in("return_log_probs", "BOOL", reshape=SCALAR),
    _in("return_context_logits", "BOOL", reshape=SCALAR),
    _in("return_generation_logits", "BOOL", reshape=SCALAR),
    _in("num_return_sequences", "INT32", reshape=SCALAR),
    _in("beam_width", "INT32"),
    _in("stream", "BOOL"),
    _in("prompt_embedding_table", "FP16", (-1, -1)),
    _in("prompt_vocab_size", "INT32"),
    _in("prompt_table_extra_id", "UINT64"),
    _in("embedding_bias_words", "STRING", (-1,)),
    _in("embedding_bias_weights", "FP32", (-1,)),
    _in("num_draft_tokens", "INT32"),
    _in("use_draft_logits", "BOOL", reshape=SCALAR),
    _in("lora_task_id", "UINT64", reshape=SCALAR),
    _in("lora_weights", "FP16", (-1, -1), ragged=True),
    _in("lora_config", "INT32", (-1, 3), ragged=True),
    _in("return_perf_metrics", "BOOL", reshape=SCALAR),
    _in("guided_decoding_guide_type", "STRING"),
    _in("guided_decoding_guide", "STRING"),
    _in("random_seed", "UINT64"),  # pre-v0.18 name of `seed`
)

# The request timings and speculation counters both backends return, in the same order and types.
TIMING_AND_SPECULATION_OUTPUTS: tuple[TensorSpec, ...] = (
    _out("arrival_time_ns", "INT64"),
    _out("first_scheduled_time_ns", "INT64"),
    _out("first_token_time_ns", "INT64"),
    _out("last_token_time_ns", "INT64"),
    _out("acceptance_rate", "FP32"),
    _out("total_accepted_draft_tokens", "INT32"),
    _out("total_draft_tokens", "INT32"),
)
LLM_OUTPUTS: tuple[TensorSpec, ...] = (
    _out("text_output", "STRING", (-1,)),
    _out("cum_log_probs", "FP32", (-1,)),
    _out("output_log_probs", "FP32", (-1, -1)),
    _out("context_logits", "FP32", (-1, -1)),
    _out("generation_logits", "FP32", (-1, -1, -1)),
    _out("batch_index", "INT32"),
    _out("sequence_index", "INT32"),
    _out("kv_cache_alloc_new_blocks", "INT32"),
    _out("kv_cache_reused_blocks", "INT32"),
    _out("kv_cache_alloc_total_blocks", "INT32"),
) + TIMING_AND_SPECULATION_OUTPUTS

# specpipe's additions. Optional inputs and extra outputs: a TRT-LLM client never notices them.
EXTENSION_INPUTS: tuple[TensorSpec, ...] = (
    _in("apply_chat_template", "BOOL"),  # wrap text_input in the tokenizer's chat template
    _in("generation_config", "STRING"),  # a GenerationConfig as JSON: the base the tensors above override
)
EXTENSION_OUTPUTS: tuple[TensorSpec, ...] = (
    _out("token_ids", "INT32", (-1,)),  # tokens carried by this response
    _out("stats_json", "STRING"),  # final response: the in-process Result.as_dict() minus text/token_ids
)

SERVED_INPUTS = LLM_INPUTS + EXTENSION_INPUTS
SERVED_OUTPUTS = LLM_OUTPUTS + EXTENSION_OUTPUTS
MAX_BATCH_SIZE = 1  # one prompt per request; dims [1] then mean shape [1, 1], as TRT-LLM clients send

LLMAPI_UPSTREAM = "NVIDIA/TensorRT-LLM@0a710573 triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt"
# The llmapi model's tensors, in upstream order (image_url and the LoRA selection are declared and refused).
LLMAPI_INPUTS: tuple[TensorSpec, ...] = (
    _in("text_input", "STRING", (-1,), optional=False),
    _in("image_url", "STRING", (-1,)),
    _in("streaming", "BOOL"),
    _in("sampling_param_best_of", "INT32"),
    _in("sampling_param_temperature", "FP32"),
    _in("sampling_param_top_k", "INT32"),
    _in("sampling_param_top_p", "FP32"),
    _in("sampling_param_frequency_penalty", "FP32"),
    _in("sampling_param_presence_penalty", "FP32"),
    _in("sampling_param_max_tokens", "INT32"),
    _in("sampling_param_stop", "STRING", (-1,)),
    _in("sampling_param_seed", "UINT64"),
    _in("sampling_param_exclude_input_from_output", "BOOL"),
    _in("sampling_param_return_perf_metrics", "BOOL"),
    _in("return_finish_reason", "BOOL"),
    _in("return_stop_reason", "BOOL"),
    _in("return_cumulative_logprob", "BOOL"),
    _in("stop", "BOOL"),
    _in("lora_id", "UINT64"),
    _in("lora_name", "STRING"),
    _in("lora_path", "STRING"),
    _in("lora_ckpt_source", "STRING"),
)
LLMAPI_OUTPUTS: tuple[TensorSpec, ...] = (
    _out("text_output", "STRING", (-1,)),
    _out("finish_reason", "STRING", (-1,)),
    _out("stop_reason", "STRING", (-1,)),
    _out("cumulative_logprob", "FP32", (-1,)),
    _out("kv_cache_reused_block", "INT32", (-1,)),
    _out("kv_cache_missed_block", "INT32", (-1,)),
    _out("kv_cache_alloc_new_blocks", "INT32", (-1,)),
    _out("kv_cache_alloc_total_blocks", "INT32", (-1,)),
    _out("kv_cache_hit_rate", "FP32", (-1,)),
) + TIMING_AND_SPECULATION_OUTPUTS
LLMAPI_SERVED_INPUTS = LLMAPI_INPUTS + EXTENSION_INPUTS
LLMAPI_SERVED_OUTPUTS = LLMAPI_OUTPUTS + EXTENSION_OUTPUTS
# llmapi name -> the tensorrt_llm_bls name whose meaning it has (values and checks are then shared)
LLMAPI_ALIASES = {
    "streaming": "stream",
    "sampling_param_temperature": "temperature",
    "sampling_param_top_k": "top_k",
    "sampling_param_top_p": "top_p",
    "sampling_param_max_tokens": "max_tokens",
    "sampling_param_seed": "seed",
    "sampling_param_stop": "stop_words",
    "sampling_param_exclude_input_from_output": "exclude_input_in_output",
    "sampling_param_return_perf_metrics": "return_perf_metrics",
    "sampling_param_frequency_penalty": "frequency_penalty",
    "sampling_param_presence_penalty": "presence_penalty",
}  # fmt: skip
_LLMAPI_ONLY = {t.name for t in LLMAPI_INPUTS} - {t.name for t in LLM_INPUTS}
# LLM API finish reasons ('stop' | 'length' | ...): an EOS token is a 'stop' there
LLMAPI_FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length"}

_NUMPY_KIND = {"STRING": "OSU", "BOOL": "b", "INT32": "iu", "UINT64": "iu", "FP32": "f", "FP16": "f"}
_INPUT_TYPES = {t.name: t.data_type for t in SERVED_INPUTS + LLMAPI_SERVED_INPUTS}


def _values(array: np.ndarray) -> np.ndarray:
    return np.asarray(array).reshape(-1)


# Inputs that TensorRT-LLM honours and specpipe does not: accepted only at the neutral value.
# name -> (is the value neutral?, what to tell the client)
_NEUTRAL: dict[str, tuple[Callable[[np.ndarray], bool], str]] = {
    "decoder_text_input": (lambda v: all(not w for w in v), "encoder-decoder models are not supported"),
    "bad_words": (lambda v: all(not w for w in v), "bad_words are not supported"),
    "beam_width": (lambda v: bool(np.all(v == 1)), "beam search is not supported: beam_width must be 1"),
    "num_return_sequences": (lambda v: bool(np.all(v == 1)), "num_return_sequences must be 1"),
    "repetition_penalty": (lambda v: bool(np.all(v == 1.0)), "repetition_penalty is not supported (send 1.0)"),
    "presence_penalty": (lambda v: bool(np.all(v == 0.0)), "presence_penalty is not supported (send 0.0)"),
    "frequency_penalty": (lambda v: bool(np.all(v == 0.0)), "frequency_penalty is not supported (send 0.0)"),
    "min_tokens": (lambda v: bool(np.all(v <= 1)), "min_tokens > 1 is not supported"),
    "return_log_probs": (lambda v: not v.any(), "return_log_probs is not supported"),
    "return_context_logits": (lambda v: not v.any(), "return_context_logits is not supported"),
    "return_generation_logits": (lambda v: not v.any(), "return_generation_logits is not supported"),
    "prompt_embedding_table": (lambda v: v.size == 0, "prompt tuning is not supported"),
    "prompt_vocab_size": (lambda v: bool(np.all(v == 0)), "prompt tuning is not supported"),
    "prompt_table_extra_id": (lambda v: bool(np.all(v == 0)), "prompt tuning is not supported"),
    "embedding_bias_words": (lambda v: all(not w for w in v), "embedding bias is not supported"),
    "embedding_bias_weights": (lambda v: v.size == 0, "embedding bias is not supported"),
    "lora_task_id": (lambda v: bool(np.all(v == 0)), "LoRA is not supported"),
    "lora_weights": (lambda v: v.size == 0, "LoRA is not supported"),
    "lora_config": (lambda v: v.size == 0, "LoRA is not supported"),
    "guided_decoding_guide_type": (lambda v: all(not w for w in v), "guided decoding is not supported"),
    "guided_decoding_guide": (lambda v: all(not w for w in v), "guided decoding is not supported"),
    # the llmapi model's own inputs
    "image_url": (lambda v: all(not w for w in v), "image inputs are not supported"),
    "sampling_param_best_of": (lambda v: bool(np.all(v == 1)), "best_of must be 1"),
    "return_stop_reason": (lambda v: not v.any(), "return_stop_reason is not supported"),
    "return_cumulative_logprob": (lambda v: not v.any(), "return_cumulative_logprob is not supported"),
    "stop": (lambda v: not v.any(), "stop requests are not supported: cancel the request instead"),
    "lora_id": (lambda v: bool(np.all(v == 0)), "LoRA is not supported"),
    "lora_name": (lambda v: all(not w for w in v), "LoRA is not supported"),
    "lora_path": (lambda v: all(not w for w in v), "LoRA is not supported"),
    "lora_ckpt_source": (lambda v: all(not w for w in v), "LoRA is not supported"),
}
# Accepted and ignored: pad_id (nothing is padded), length_penalty (beam search only),
# use_draft_logits (the draft's probabilities q are always used when sampling).


@dataclass
class ServedRequest:
    """One parsed request: the prompt, GenerationConfig fields, and how to answer."""

    prompt: str
    config: dict[str, Any]  # GenerationConfig fields (nested "sampling" dict), validated by the deployment
    stream: bool = False
    chat: bool = False
    exclude_input_in_output: Optional[bool] = None  # None: the model's default parameter
    return_perf_metrics: bool = False
    end_id: Optional[int] = None  # replaces the deployment's EOS ids; < 0 = do not stop at EOS
    llmapi: bool = False  # sent with the llmapi model's names: streamed text is cumulative, max tokens optional
    return_finish_reason: bool = False


def parse_request(tensors: Mapping[str, np.ndarray]) -> ServedRequest:
    """Check a request's tensors and turn them into a ServedRequest. Bad input raises UsageError."""
    for name, array in tensors.items():
        _check_type(name, array)
    for name, (neutral, why) in _NEUTRAL.items():
        if name in tensors and not neutral(_values(tensors[name])):
            raise UsageError(f"{name}: {why}")
    llmapi = any(name in _LLMAPI_ONLY for name in tensors)
    return_finish_reason = bool(_scalar(tensors, "return_finish_reason")) if "return_finish_reason" in tensors else False
    tensors = _with_bls_names(tensors)
    if llmapi and "max_tokens" not in tensors:  # optional there (SamplingParams' default): the deployment's default
        tensors = {**tensors, "max_tokens": None}

    if "text_input" not in tensors:
        raise UsageError("missing required input 'text_input'")
    prompt = _string(tensors, "text_input")
    if not prompt:
        raise UsageError("text_input is empty")
    if "max_tokens" not in tensors:
        raise UsageError("missing required input 'max_tokens'")

    config = _base_config(tensors)
    sampling = config.setdefault("sampling", {})
    if tensors["max_tokens"] is not None:
        max_tokens = _scalar(tensors, "max_tokens")
        if max_tokens < 1:
            raise UsageError(f"max_tokens must be >= 1, got {max_tokens}")
        config["max_new_tokens"] = max_tokens
    if "temperature" in tensors:
        temperature = _scalar(tensors, "temperature")
        if not temperature >= 0.0:  # also refuses NaN
            raise UsageError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        sampling["temperature"] = temperature
    if "top_k" in tensors:
        top_k = _scalar(tensors, "top_k")
        if top_k < 0:
            raise UsageError(f"top_k must be >= 0 (0 = off), got {top_k}")
        sampling["top_k"] = top_k
    if "top_p" in tensors:
        top_p = _scalar(tensors, "top_p")
        if not 0.0 <= top_p <= 1.0:
            raise UsageError(f"top_p must be in [0, 1] (0 or 1 = off), got {top_p}")
        sampling["top_p"] = top_p if top_p > 0.0 else 1.0  # TensorRT-LLM's SamplingConfig: top_p 0.0 = off
    for name in ("seed", "random_seed"):
        if name in tensors:
            config["seed"] = _scalar(tensors, name)
    if "num_draft_tokens" in tensors:
        # A TRT-LLM client asks for exactly K drafts per step, or 0: the target alone.
        config.update(DecodingPolicy.requested(int(_scalar(tensors, "num_draft_tokens"))))
    if "stop_words" in tensors:
        config["stop"] = [w for w in _strings(tensors, "stop_words") if w]

    end_id = _scalar(tensors, "end_id") if "end_id" in tensors else None
    return ServedRequest(
        prompt=prompt,
        config=config,
        stream=bool(_scalar(tensors, "stream")) if "stream" in tensors else False,
        chat=bool(_scalar(tensors, "apply_chat_template")) if "apply_chat_template" in tensors else False,
        exclude_input_in_output=(
            bool(_scalar(tensors, "exclude_input_in_output")) if "exclude_input_in_output" in tensors else None
        ),
        return_perf_metrics=bool(_scalar(tensors, "return_perf_metrics")) if "return_perf_metrics" in tensors else False,
        end_id=end_id,
        llmapi=llmapi,
        return_finish_reason=return_finish_reason,
    )


def _with_bls_names(tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """llmapi names renamed to their tensorrt_llm_bls twins; both names of one setting is a conflict."""
    renamed: dict[str, Any] = {}
    for name, array in tensors.items():
        if name == "return_finish_reason":
            continue
        bls = LLMAPI_ALIASES.get(name, name)
        if bls in renamed:
            twin = name if bls != name else next(k for k, v in LLMAPI_ALIASES.items() if v == bls)
            raise UsageError(f"send one of {bls!r} and {twin!r}, not both")
        renamed[bls] = array
    return renamed


def _base_config(tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
    if "generation_config" not in tensors:
        return {}
    import json

    try:
        config = json.loads(_string(tensors, "generation_config"))
    except json.JSONDecodeError as exc:
        raise UsageError(f"generation_config is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise UsageError("generation_config must be a JSON object of GenerationConfig fields")
    return config


def _check_type(name: str, array: np.ndarray) -> None:
    expected = _INPUT_TYPES.get(name)
    if expected is None:
        raise UsageError(f"unknown input {name!r}")
    if np.asarray(array).dtype.kind not in _NUMPY_KIND[expected]:
        raise UsageError(f"input {name!r} must be TYPE_{expected}, got numpy dtype {np.asarray(array).dtype}")


def _scalar(tensors: Mapping[str, np.ndarray], name: str):
    values = _values(tensors[name])
    if values.size != 1:
        raise UsageError(f"{name} takes one value per request, got {values.size}")
    return values[0].item()


def _strings(tensors: Mapping[str, np.ndarray], name: str) -> list[str]:
    out = []
    for value in _values(tensors[name]):
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UsageError(f"{name} is not valid UTF-8: {exc}") from None
        if not isinstance(value, str):
            raise UsageError(f"{name} must hold strings, got {type(value).__name__}")
        out.append(value)
    return out


def _string(tensors: Mapping[str, np.ndarray], name: str) -> str:
    values = _strings(tensors, name)
    if len(values) != 1:
        raise UsageError(f"{name} takes one string per request, got {len(values)}")
    return values[0]
