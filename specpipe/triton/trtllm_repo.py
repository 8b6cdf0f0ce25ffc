"""The Triton model repository for TensorRT-LLM engines, in tensorrtllm_backend's layout and names.

    ensemble            preprocessing -> tensorrt_llm -> postprocessing (target only, upstream's design)
    tensorrt_llm_bls    speculative requests: num_draft_tokens > 0 runs tensorrt_llm_draft, then the target
    preprocessing / postprocessing   tokenizer in and out (Python backend)
    tensorrt_llm / tensorrt_llm_draft   the C++ tensorrtllm backend on the target / draft engines

Every config.pbtxt comes from specpipe.triton.model_config.ModelSpec (Triton's own protobuf), never from
the upstream templates with `${...}` filled in. Tensor names, types and shapes are those of the templates
in NVIDIA/TensorRT-LLM triton_backend/all_models/inflight_batcher_llm/<model>/config.pbtxt (commit of the
copy read, per model, next to each table); parameter keys are the keys inside those files (so
`gpt_model_path`, which fill_template.py fills from `engine_dir`). The Python models' model.py files are
upstream code: a real build copies them from the pinned checkout, and `compare_with_templates` checks the
tensors here against that checkout's templates, so a renamed tensor fails the build instead of the server.

The `llmapi` flow writes one model instead: Triton's LLM-API model (`tensorrt_llm`, Python backend) and
its model.yaml (specpipe.builder.trtllm.LlmApiModelYaml).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field
from tritonclient.grpc import model_config_pb2 as mc

from specpipe.engines import upstream
from specpipe.triton.model_config import CONFIG_FILE, DynamicBatching, EnsembleStep, ModelSpec, TensorSpec, parse_config

LOGITS_TYPE = "FP32"  # ${logits_datatype}; TYPE_FP32 in upstream's draft-target example
ENCODER_FEATURES_TYPE = "FP16"  # ${encoder_input_features_data_type}; TYPE_FP16 for non-mllama models
PROMPT_TABLE_TYPE = "FP16"  # ${prompt_embedding_table_data_type}
# tensorrt_llm/config.pbtxt sets this path literally; orchestrator mode (--multi-model) spawns it
EXECUTOR_WORKER = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"


def _t(name: str, dtype: str, dims: tuple[int, ...], *, optional: bool = False, scalar: bool = False, ragged: bool = False) -> TensorSpec:
    """`scalar`: the template's `reshape: { shape: [ ] }` (the model sees one value per request)."""
    return TensorSpec(name=name, data_type=dtype, dims=dims, optional=optional, reshape=() if scalar else None, allow_ragged_batch=ragged)


def _opt(name: str, dtype: str, dims: tuple[int, ...] = (1,), **kw) -> TensorSpec:
    return _t(name, dtype, dims, optional=True, **kw)


# ---- tensorrt_llm/config.pbtxt (@0c8de69a) ----------------------------------------------------------------
LLM_INPUTS = (
    _opt("input_ids", "INT32", (-1,), ragged=True),
    _opt("encoder_input_features", ENCODER_FEATURES_TYPE, (-1, -1), ragged=True),
    _opt("encoder_output_lengths", "INT32", scalar=True),
    _t("input_lengths", "INT32", (1,), scalar=True),
    _t("request_output_len", "INT32", (1,), scalar=True),
    _opt("num_return_sequences", "INT32", scalar=True),
    _opt("draft_input_ids", "INT32", (-1,), ragged=True),
    _opt("decoder_input_ids", "INT32", (-1,), ragged=True),
    _opt("decoder_input_lengths", "INT32", scalar=True),
    _opt("draft_logits", LOGITS_TYPE, (-1, -1), ragged=True),
    _opt("draft_acceptance_threshold", "FP32", scalar=True),
    _opt("end_id", "INT32", scalar=True),
    _opt("pad_id", "INT32", scalar=True),
    _opt("stop_words_list", "INT32", (2, -1), ragged=True),
    _opt("bad_words_list", "INT32", (2, -1), ragged=True),
    _opt("embedding_bias", "FP32", (-1,), ragged=True),
    _opt("beam_width", "INT32", scalar=True),
    _opt("temperature", "FP32", scalar=True),
    _opt("runtime_top_k", "INT32", scalar=True),
    _opt("runtime_top_p", "FP32", scalar=True),
    _opt("runtime_top_p_min", "FP32", scalar=True),
    _opt("runtime_top_p_decay", "FP32", scalar=True),
    _opt("runtime_top_p_reset_ids", "INT32", scalar=True),
    _opt("len_penalty", "FP32", scalar=True),
    _opt("early_stopping", "BOOL", scalar=True),
    _opt("repetition_penalty", "FP32", scalar=True),
    _opt("min_tokens", "INT32", scalar=True),
    _opt("beam_search_diversity_rate", "FP32", scalar=True),
    _opt("presence_penalty", "FP32", scalar=True),
    _opt("frequency_penalty", "FP32", scalar=True),
    _opt("seed", "UINT64", scalar=True),
    _opt("return_log_probs", "BOOL", scalar=True),
    _opt("return_context_logits", "BOOL", scalar=True),
    _opt("return_generation_logits", "BOOL", scalar=True),
    _opt("return_perf_metrics", "BOOL", scalar=True),
    _opt("return_num_input_tokens", "BOOL", scalar=True),
    _opt("return_num_output_tokens", "BOOL", scalar=True),
    _opt("exclude_input_in_output", "BOOL", scalar=True),
    _opt("stop", "BOOL", scalar=True),
    _opt("streaming", "BOOL", scalar=True),
    _opt("prompt_embedding_table", PROMPT_TABLE_TYPE, (-1, -1), ragged=True),
    _opt("prompt_table_extra_ids", "UINT64", (-1,), ragged=True),
    _opt("prompt_vocab_size", "INT32", scalar=True),
    _opt("cross_attention_mask", "BOOL", (-1, -1), ragged=True),
    _opt("mrope_rotary_cos_sin", "FP32", (-1,)),
    _opt("mrope_position_deltas", "INT64", (1,)),
    _opt("lora_task_id", "UINT64", scalar=True),
    _opt("lora_weights", "FP16", (-1, -1), ragged=True),
    _opt("lora_config", "INT32", (-1, 3), ragged=True),
    _opt("context_phase_params", "UINT8", (-1,), ragged=True),
    _opt("skip_cross_attn_blocks", "BOOL", (1,), ragged=True),
    _opt("retention_token_range_starts", "INT32", (-1,), ragged=True),
    _opt("retention_token_range_ends", "INT32", (-1,), ragged=True),
    _opt("retention_token_range_priorities", "INT32", (-1,), ragged=True),
    _opt("retention_token_range_durations_ms", "INT32", (-1,), ragged=True),
    _opt("retention_decode_priority", "INT32", (1,), ragged=True),
    _opt("retention_decode_duration_ms", "INT32", (1,), ragged=True),
    _opt("guided_decoding_guide_type", "STRING", (1,), ragged=True),
    _opt("guided_decoding_guide", "STRING", (1,), ragged=True),
    _opt("lookahead_window_size", "INT32", (1,), ragged=True),
    _opt("lookahead_ngram_size", "INT32", (1,), ragged=True),
    _opt("lookahead_verification_set_size", "INT32", (1,), ragged=True),
)

# Outputs shared by tensorrt_llm, tensorrt_llm_bls and ensemble (after their first, model-specific ones).
PERF_OUTPUTS = (
    _t("kv_cache_alloc_new_blocks", "INT32", (1,)),
    _t("kv_cache_reused_blocks", "INT32", (1,)),
    _t("kv_cache_alloc_total_blocks", "INT32", (1,)),
    _t("arrival_time_ns", "INT64", (1,)),
    _t("first_scheduled_time_ns", "INT64", (1,)),
    _t("first_token_time_ns", "INT64", (1,)),
    _t("last_token_time_ns", "INT64", (1,)),
    _t("acceptance_rate", "FP32", (1,)),
    _t("total_accepted_draft_tokens", "INT32", (1,)),
    _t("total_draft_tokens", "INT32", (1,)),
    _t("num_input_tokens", "INT32", (1,)),
    _t("num_output_tokens", "INT32", (1,)),
)
LOGPROB_OUTPUTS = (
    _t("cum_log_probs", "FP32", (-1,)),
    _t("output_log_probs", "FP32", (-1, -1)),
    _t("context_logits", LOGITS_TYPE, (-1, -1)),
    _t("generation_logits", LOGITS_TYPE, (-1, -1, -1)),
    _t("batch_index", "INT32", (1,)),
    _t("sequence_index", "INT32", (1,)),
)
LLM_OUTPUTS = (
    _t("output_ids", "INT32", (-1, -1)),
    _t("sequence_length", "INT32", (-1,)),
    *LOGPROB_OUTPUTS,
    _t("context_phase_params", "UINT8", (-1,)),
    *PERF_OUTPUTS,
)

# ---- tensorrt_llm_bls/config.pbtxt (@0193dbd4) and ensemble/config.pbtxt (@2a9abd95) --------------------
# The client-facing request: the names a client written for tensorrtllm_backend sends.
_REQUEST_SAMPLING = (
    _opt("end_id", "INT32"),
    _opt("pad_id", "INT32"),
    _opt("top_k", "INT32"),
    _opt("top_p", "FP32"),
    _opt("temperature", "FP32"),
    _opt("length_penalty", "FP32"),
    _opt("repetition_penalty", "FP32"),
    _opt("min_tokens", "INT32"),
    _opt("presence_penalty", "FP32"),
    _opt("frequency_penalty", "FP32"),
    _opt("seed", "UINT64"),
)
_LORA_GUIDED = (
    _opt("lora_task_id", "UINT64"),
    _opt("lora_weights", "FP16", (-1, -1), ragged=True),
    _opt("lora_config", "INT32", (-1, 3), ragged=True),
)
BLS_INPUTS = (
    _t("text_input", "STRING", (1,)),
    _opt("decoder_text_input", "STRING"),
    _opt("image_input", "FP16", (-1, 3, -1, -1)),
    _opt("image_bytes_input", "UINT8", (-1, -1, -1, -1)),
    _opt("image_url_input", "STRING"),
    _opt("video_bytes_input", "UINT8", (-1, -1, -1, -1)),
    _t("max_tokens", "INT32", (1,)),
    _opt("bad_words", "STRING", (-1,)),
    _opt("stop_words", "STRING", (-1,)),
    _opt("exclude_input_in_output", "BOOL"),
    *_REQUEST_SAMPLING,
    _opt("return_log_probs", "BOOL", scalar=True),
    _opt("return_context_logits", "BOOL", scalar=True),
    _opt("return_generation_logits", "BOOL", scalar=True),
    _opt("num_return_sequences", "INT32", scalar=True),
    _opt("beam_width", "INT32"),
    _opt("stream", "BOOL"),
    _opt("prompt_embedding_table", "FP16", (-1, -1)),
    _opt("prompt_vocab_size", "INT32"),
    _opt("prompt_table_extra_id", "UINT64"),
    _opt("embedding_bias_words", "STRING", (-1,)),
    _opt("embedding_bias_weights", "FP32", (-1,)),
    _opt("num_draft_tokens", "INT32"),
    _opt("use_draft_logits", "BOOL", scalar=True),
    _opt("lora_task_id", "UINT64", scalar=True),
    _opt("lora_weights", "FP16", (-1, -1), ragged=True),
    _opt("lora_config", "INT32", (-1, 3), ragged=True),
    _opt("return_perf_metrics", "BOOL", scalar=True),
    _opt("return_num_input_tokens", "BOOL", scalar=True),
    _opt("return_num_output_tokens", "BOOL", scalar=True),
    _opt("guided_decoding_guide_type", "STRING"),
    _opt("guided_decoding_guide", "STRING"),
)
TEXT_OUTPUTS = (_t("text_output", "STRING", (-1,)), *LOGPROB_OUTPUTS, *PERF_OUTPUTS)

ENSEMBLE_INPUTS = (
    _t("text_input", "STRING", (1,)),
    _opt("decoder_text_input", "STRING"),
    _t("max_tokens", "INT32", (1,)),
    _opt("num_return_sequences", "INT32"),
    _opt("bad_words", "STRING", (-1,)),
    _opt("stop_words", "STRING", (-1,)),
    _opt("exclude_input_in_output", "BOOL"),
    *_REQUEST_SAMPLING,
    _opt("return_log_probs", "BOOL"),
    _opt("return_context_logits", "BOOL"),
    _opt("return_generation_logits", "BOOL"),
    _opt("return_perf_metrics", "BOOL"),
    _opt("return_num_input_tokens", "BOOL"),
    _opt("return_num_output_tokens", "BOOL"),
    _opt("beam_width", "INT32"),
    _opt("stream", "BOOL"),
    _opt("prompt_embedding_table", "FP16", (-1, -1)),
    _opt("prompt_table_extra_id", "UINT64"),
    _opt("prompt_vocab_size", "INT32"),
    _opt("embedding_bias_words", "STRING", (-1,)),
    _opt("embedding_bias_weights", "FP32", (-1,)),
    *_LORA_GUIDED,
    _opt("guided_decoding_guide_type", "STRING", ragged=True),
    _opt("guided_decoding_guide", "STRING", ragged=True),
)

# ---- preprocessing/config.pbtxt (@08dc37e3), postprocessing/config.pbtxt (@89fd9b74) ---------------------
PRE_INPUTS = (
    _t("QUERY", "STRING", (1,)),
    _opt("DECODER_QUERY", "STRING"),
    _opt("IMAGE_BYTES", "UINT8", (-1, -1, -1, -1)),
    _opt("IMAGE_URL", "STRING"),
    _opt("IMAGES", "STRING", (-1,)),
    _opt("VIDEO_BYTES", "UINT8", (-1, -1, -1, -1)),
    _t("REQUEST_OUTPUT_LEN", "INT32", (1,)),
    _opt("BAD_WORDS_DICT", "STRING", (-1,)),
    _opt("STOP_WORDS_DICT", "STRING", (-1,)),
    _opt("EMBEDDING_BIAS_WORDS", "STRING", (-1,)),
    _opt("EMBEDDING_BIAS_WEIGHTS", "FP32", (-1,)),
    _opt("END_ID", "INT32"),
    _opt("PAD_ID", "INT32"),
    _opt("PROMPT_TABLE_EXTRA_ID", "UINT64"),
)
PRE_OUTPUTS = (
    _t("INPUT_ID", "INT32", (-1,)),
    _t("REQUEST_INPUT_LEN", "INT32", (1,)),
    _t("DECODER_INPUT_ID", "INT32", (-1,)),
    _t("REQUEST_DECODER_INPUT_LEN", "INT32", (1,)),
    _t("BAD_WORDS_IDS", "INT32", (2, -1)),
    _t("STOP_WORDS_IDS", "INT32", (2, -1)),
    _t("EMBEDDING_BIAS", "FP32", (-1,)),
    _t("REQUEST_OUTPUT_LEN", "INT32", (-1,)),
    _t("OUT_END_ID", "INT32", (1,)),
    _t("OUT_PAD_ID", "INT32", (1,)),
    _t("OUT_PROMPT_TABLE_EXTRA_IDS", "UINT64", (-1,)),
    _t("PIXEL_VALUES", "FP16", (-1, -1, -1, -1)),
    _t("ASPECT_RATIO_IDS", "INT64", (-1,)),
    _t("ASPECT_RATIO_MASK", "INT64", (-1, -1)),
    _t("CROSS_ATTENTION_MASK", "INT64", (-1, -1, -1)),
    _t("IMAGE_SIZES", "INT64", (-1, 2)),
    _t("IS_VIDEO_INPUT", "BOOL", (1,)),
    _t("ATTENTION_MASK", "INT64", (-1,)),
    _t("IMAGE_GRID_THW", "INT64", (3,)),
    _t("VISION_INPUT_ID", "INT32", (-1,)),
)
POST_INPUTS = (_t("TOKENS_BATCH", "INT32", (-1, -1)), _t("SEQUENCE_LENGTH", "INT32", (-1,)))
POST_OUTPUTS = (_t("OUTPUT", "STRING", (-1,)),)

# ensemble_scheduling of ensemble/config.pbtxt (@2a9abd95): composing model's tensor -> ensemble tensor
PRE_STEP_INPUTS = {
    "QUERY": "text_input", "DECODER_QUERY": "decoder_text_input", "REQUEST_OUTPUT_LEN": "max_tokens",
    "BAD_WORDS_DICT": "bad_words", "STOP_WORDS_DICT": "stop_words", "EMBEDDING_BIAS_WORDS": "embedding_bias_words",
    "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights", "END_ID": "end_id", "PAD_ID": "pad_id",
    "PROMPT_TABLE_EXTRA_ID": "prompt_table_extra_id",
}  # fmt: skip
PRE_STEP_OUTPUTS = {
    "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN", "INPUT_ID": "_INPUT_ID",
    "REQUEST_DECODER_INPUT_LEN": "_REQUEST_DECODER_INPUT_LEN", "DECODER_INPUT_ID": "_DECODER_INPUT_ID",
    "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "STOP_WORDS_IDS": "_STOP_WORDS_IDS", "BAD_WORDS_IDS": "_BAD_WORDS_IDS",
    "EMBEDDING_BIAS": "_EMBEDDING_BIAS", "OUT_END_ID": "_PREPROCESSOR_END_ID", "OUT_PAD_ID": "_PREPROCESSOR_PAD_ID",
    "OUT_PROMPT_TABLE_EXTRA_IDS": "_OUT_PROMPT_TABLE_EXTRA_IDS",
}  # fmt: skip
LLM_STEP_INPUTS = {
    "input_ids": "_INPUT_ID", "decoder_input_ids": "_DECODER_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN",
    "decoder_input_lengths": "_REQUEST_DECODER_INPUT_LEN", "exclude_input_in_output": "exclude_input_in_output",
    "request_output_len": "_REQUEST_OUTPUT_LEN", "end_id": "_PREPROCESSOR_END_ID", "pad_id": "_PREPROCESSOR_PAD_ID",
    "embedding_bias": "_EMBEDDING_BIAS", "runtime_top_k": "top_k", "runtime_top_p": "top_p",
    "temperature": "temperature", "len_penalty": "length_penalty", "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens", "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "seed": "seed", "return_log_probs": "return_log_probs", "return_context_logits": "return_context_logits",
    "return_generation_logits": "return_generation_logits", "return_perf_metrics": "return_perf_metrics",
    "return_num_input_tokens": "return_num_input_tokens", "return_num_output_tokens": "return_num_output_tokens",
    "num_return_sequences": "num_return_sequences", "beam_width": "beam_width", "streaming": "stream",
    "prompt_embedding_table": "prompt_embedding_table", "prompt_vocab_size": "prompt_vocab_size",
    "stop_words_list": "_STOP_WORDS_IDS", "bad_words_list": "_BAD_WORDS_IDS",
    "prompt_table_extra_ids": "_OUT_PROMPT_TABLE_EXTRA_IDS", "lora_task_id": "lora_task_id",
    "lora_weights": "lora_weights", "lora_config": "lora_config",
    "guided_decoding_guide_type": "guided_decoding_guide_type", "guided_decoding_guide": "guided_decoding_guide",
}  # fmt: skip
LLM_STEP_OUTPUTS = {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH"} | {
    t.name: t.name for t in (*LOGPROB_OUTPUTS, *PERF_OUTPUTS)
}
POST_STEP_INPUTS = {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"}
POST_STEP_OUTPUTS = {"OUTPUT": "text_output"}

# ---- llmapi/tensorrt_llm/config.pbtxt (@0a710573) -------------------------------------------------------
LLMAPI_INPUTS = (
    _t("text_input", "STRING", (-1,)),
    _opt("image_url", "STRING", (-1,)),
    _opt("streaming", "BOOL"),
    _opt("sampling_param_best_of", "INT32"),
    _opt("sampling_param_temperature", "FP32"),
    _opt("sampling_param_top_k", "INT32"),
    _opt("sampling_param_top_p", "FP32"),
    _opt("sampling_param_frequency_penalty", "FP32"),
    _opt("sampling_param_presence_penalty", "FP32"),
    _opt("sampling_param_max_tokens", "INT32"),
    _opt("sampling_param_stop", "STRING", (-1,)),
    _opt("sampling_param_seed", "UINT64"),
    _opt("sampling_param_exclude_input_from_output", "BOOL"),
    _opt("sampling_param_return_perf_metrics", "BOOL"),
    _opt("return_finish_reason", "BOOL"),
    _opt("return_stop_reason", "BOOL"),
    _opt("return_cumulative_logprob", "BOOL"),
    _opt("stop", "BOOL"),
    _opt("lora_id", "UINT64"),
    _opt("lora_name", "STRING"),
    _opt("lora_path", "STRING"),
    _opt("lora_ckpt_source", "STRING"),
)
LLMAPI_OUTPUTS = (
    _t("text_output", "STRING", (-1,)),
    _t("finish_reason", "STRING", (-1,)),
    _t("stop_reason", "STRING", (-1,)),
    _t("cumulative_logprob", "FP32", (-1,)),
    _t("kv_cache_reused_block", "INT32", (-1,)),
    _t("kv_cache_missed_block", "INT32", (-1,)),
    _t("kv_cache_alloc_new_blocks", "INT32", (-1,)),
    _t("kv_cache_alloc_total_blocks", "INT32", (-1,)),
    _t("kv_cache_hit_rate", "FP32", (-1,)),
    _t("arrival_time_ns", "INT64", (1,)),
    _t("first_scheduled_time_ns", "INT64", (1,)),
    _t("first_token_time_ns", "INT64", (1,)),
    _t("last_token_time_ns", "INT64", (1,)),
    _t("acceptance_rate", "FP32", (1,)),
    _t("total_accepted_draft_tokens", "INT32", (1,)),
    _t("total_draft_tokens", "INT32", (1,)),
)


class TrtllmRepoSettings(BaseModel):
    """What differs between deployments; everything else is upstream's layout."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_size: int = Field(ge=1, description="triton_max_batch_size")
    tokenizer_dir: str
    target_engine_dir: str
    draft_engine_dir: str
    target_gpus: tuple[int, ...]
    draft_gpus: tuple[int, ...]
    target_kv_fraction: float = Field(gt=0, le=1)
    draft_kv_fraction: float = Field(gt=0, le=1)
    instance_count: int = Field(1, ge=1, description="preprocessing / postprocessing / BLS instances")
    max_queue_delay_microseconds: int = 0


def _llm_model(name: str, engine_dir: str, gpus: tuple[int, ...], kv_fraction: float, s: TrtllmRepoSettings) -> ModelSpec:
    """tensorrt_llm or tensorrt_llm_draft. Not decoupled: the BLS calls both without streaming (its
    speculative path refuses streaming requests: lib/decode.py, "streaming is not supported with
    speculative decoding")."""
    return ModelSpec(
        name=name,
        backend=upstream.TENSORRTLLM_BACKEND,
        max_batch_size=s.max_batch_size,
        decoupled=False,
        dynamic_batching=DynamicBatching(
            preferred_batch_size=(s.max_batch_size,), max_queue_delay_microseconds=s.max_queue_delay_microseconds
        ),
        inputs=LLM_INPUTS,
        outputs=LLM_OUTPUTS,
        instance_count=1,
        instance_kind="KIND_CPU",  # the backend places the engine on gpu_device_ids itself
        parameters={
            "max_beam_width": "1",
            "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
            "gpt_model_type": "inflight_fused_batching",  # ${batching_strategy}
            "gpt_model_path": engine_dir,  # ${engine_dir}
            "kv_cache_free_gpu_mem_fraction": f"{kv_fraction:g}",
            # the draft-target loop re-sends accepted tokens; reuse keeps their KV (needs paged context FMHA)
            "enable_kv_cache_reuse": "true",
            # and it re-sends the whole sequence as a prompt: chunked context lifts the runtime's input limit to
            # max_seq_len - 1 (upstream.py, defect 4), where max_input_len would refuse a long conversation
            "enable_chunked_context": "true",
            "exclude_input_in_output": "true",
            "gpu_device_ids": ",".join(str(g) for g in gpus),
            "executor_worker_path": EXECUTOR_WORKER,
        },
    )


def trtllm_models(s: TrtllmRepoSettings) -> list[ModelSpec]:
    """The six models of the engine-flow repository."""
    python_batching = DynamicBatching(preferred_batch_size=(s.max_batch_size,), max_queue_delay_microseconds=s.max_queue_delay_microseconds)
    return [
        ModelSpec(
            name="ensemble",
            platform="ensemble",
            max_batch_size=s.max_batch_size,
            inputs=ENSEMBLE_INPUTS,
            outputs=TEXT_OUTPUTS,
            instance_count=None,
            ensemble_steps=(
                EnsembleStep(model_name="preprocessing", input_map=PRE_STEP_INPUTS, output_map=PRE_STEP_OUTPUTS),
                EnsembleStep(model_name="tensorrt_llm", input_map=LLM_STEP_INPUTS, output_map=LLM_STEP_OUTPUTS),
                EnsembleStep(model_name="postprocessing", input_map=POST_STEP_INPUTS, output_map=POST_STEP_OUTPUTS),
            ),
        ),
        ModelSpec(
            name="preprocessing", backend="python", max_batch_size=s.max_batch_size, inputs=PRE_INPUTS, outputs=PRE_OUTPUTS,
            dynamic_batching=python_batching, instance_count=s.instance_count,
            # model.py reads multimodal_model_path unguarded; "" means no multimodal encoder (upstream.py, defect 2)
            parameters={"tokenizer_dir": s.tokenizer_dir, "add_special_tokens": "true", "multimodal_model_path": ""},
        ),  # fmt: skip
        _llm_model("tensorrt_llm", s.target_engine_dir, s.target_gpus, s.target_kv_fraction, s),
        _llm_model("tensorrt_llm_draft", s.draft_engine_dir, s.draft_gpus, s.draft_kv_fraction, s),
        ModelSpec(
            name="tensorrt_llm_bls", backend="python", max_batch_size=s.max_batch_size, decoupled=False,
            inputs=BLS_INPUTS, outputs=TEXT_OUTPUTS, instance_count=s.instance_count,
            parameters={
                "accumulate_tokens": "false",
                "tensorrt_llm_model_name": "tensorrt_llm",
                "tensorrt_llm_draft_model_name": "tensorrt_llm_draft",
            },
        ),  # fmt: skip
        ModelSpec(
            name="postprocessing", backend="python", max_batch_size=s.max_batch_size, inputs=POST_INPUTS,
            outputs=POST_OUTPUTS, dynamic_batching=DynamicBatching(), instance_count=s.instance_count,
            parameters={"tokenizer_dir": s.tokenizer_dir, "skip_special_tokens": "true"},
        ),  # fmt: skip
    ]


def llmapi_models(*, max_batch_size: int, decoupled: bool, instance_count: int = 1) -> list[ModelSpec]:
    """Triton's LLM-API model. Upstream's config.pbtxt leaves max_batch_size and decoupled to model.yaml's
    triton_config (auto_complete_config), but launch_triton_server.py disables auto-complete, so Triton would
    treat the model as not decoupled while model.py streams: they are written here too, with model.yaml's
    values (upstream.LAUNCH_DISABLES_AUTO_COMPLETE, defect 5)."""
    return [
        ModelSpec(
            name="tensorrt_llm", backend="python", max_batch_size=max_batch_size, decoupled=decoupled,
            inputs=LLMAPI_INPUTS, outputs=LLMAPI_OUTPUTS, instance_count=instance_count,
        )  # fmt: skip
    ]


def repository_files(models: list[ModelSpec], repo_dir: Path, flow: str) -> list[Path]:
    """Every file a repository write puts under repo_dir (config.pbtxt, version folders, upstream model.py)."""
    files = []
    for model in models:
        files.append(repo_dir / model.name / CONFIG_FILE)
        for rel in upstream_model_files(model.name, flow):
            files.append(repo_dir / model.name / rel)
    if flow == "llmapi":
        files.append(repo_dir / "tensorrt_llm" / "1" / "model.yaml")
    return files


def upstream_model_files(model_name: str, flow: str) -> tuple[str, ...]:
    if flow == "llmapi":
        return upstream.LLMAPI_MODEL_FILES if model_name == "tensorrt_llm" else ()
    return upstream.PYTHON_MODEL_FILES.get(model_name, ())


def write_repository(models: list[ModelSpec], repo_dir: Path, *, model_yaml: Optional[str] = None) -> list[Path]:
    """Write each config.pbtxt (and version folder "1"; the C++ backend needs one even when empty)."""
    written = []
    for model in models:
        written.append(model.write(repo_dir / model.name))
        (repo_dir / model.name / "1").mkdir(exist_ok=True)
    if model_yaml is not None:
        path = repo_dir / "tensorrt_llm" / "1" / "model.yaml"
        path.write_text(model_yaml)
        written.append(path)
    return written


def copy_upstream_model_files(repo_dir: Path, checkout: Path, flow: str, model_names: list[str]) -> list[Path]:
    """The Python models' code from the pinned TensorRT-LLM checkout (specpipe does not vendor it)."""
    templates = checkout / (upstream.LLMAPI_TEMPLATES_DIR if flow == "llmapi" else upstream.TRITON_TEMPLATES_DIR)
    copied = []
    for name in model_names:
        source_model = "" if flow == "llmapi" else name
        for rel in upstream_model_files(name, flow):
            src = templates / source_model / rel
            dst = repo_dir / name / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
            copied.append(dst)
    return copied


# ---- drift check against the pinned checkout's templates --------------------------------------------------

_PLACEHOLDER = re.compile(r"\$\{[A-Za-z0-9_]+\}")


def parse_template(text: str):
    """An upstream config.pbtxt template as a ModelConfig: `${...}` placeholders outside quotes get a value
    of the right kind (a data type after `data_type:`, `false` after `decoupled:`, else 1)."""

    def fill(match: re.Match) -> str:
        before = text[: match.start()].rstrip().rsplit("\n", 1)[-1]
        if before.endswith('"'):
            return match.group(0)
        key = before.rsplit(":", 1)[0].strip().split()[-1] if ":" in before else ""
        if key == "data_type":
            return "TYPE_FP32"
        if key == "decoupled":
            return "false"
        return "1"

    return parse_config(_PLACEHOLDER.sub(fill, text))


def compare_with_templates(models: list[ModelSpec], templates_dir: Path) -> list[str]:
    """Tensor names (and, where the template fixes them, types and dims) that differ from upstream's."""
    problems = []
    for model in models:
        template_name = "tensorrt_llm" if model.name == "tensorrt_llm_draft" else model.name
        path = templates_dir / template_name / CONFIG_FILE
        if not path.is_file():
            problems.append(f"{model.name}: no upstream template at {path}")
            continue
        theirs = parse_template(path.read_text())
        ours = model.to_proto()
        for kind in ("input", "output"):
            mine = {t.name: t for t in getattr(ours, kind)}
            upstream_tensors = {t.name: t for t in getattr(theirs, kind)}
            for name in sorted(mine.keys() ^ upstream_tensors.keys()):
                where = "only in specpipe's" if name in mine else "only in upstream's"
                problems.append(f"{model.name}: {kind} {name!r} is {where} config")
            for name in sorted(mine.keys() & upstream_tensors.keys()):
                a, b = mine[name], upstream_tensors[name]
                placeholder_type = b.data_type == mc.TYPE_FP32  # a filled-in ${..._datatype}: any type is upstream's
                if (a.data_type != b.data_type and not placeholder_type) or list(a.dims) != list(b.dims):
                    problems.append(f"{model.name}: {kind} {name!r} differs from upstream's (type/dims)")
    return problems
