"""Upstream names and versions the GPU backends depend on, each with the file it was checked against.

Nothing here was run on a GPU: every value was read in the upstream sources named next to it (public
GitHub repositories and NVIDIA's published docs, read in November 2026). When upstream changes a name,
this is the one file to update; tests/test_gpu_plan.py holds its own copy of the expectations so a wrong
edit here fails a test instead of passing silently.
"""

from __future__ import annotations

# The head's format is a checkpoint fact; re-exported here so this file lists every upstream name.
from specpipe.checkpoint.eagle3 import (EAGLE3_ARCHITECTURES, EAGLE3_CONFIG_BLOCK, EAGLE3_DRAFT_VOCAB_KEY,  # noqa: F401
                                       EAGLE3_HEAD_TENSORS, EAGLE3_LAYER_IDS_KEY, EAGLE3_TENSORS,
                                       SPECULATORS_ARCHITECTURES)

# ---- TensorRT-LLM: which release still has the TensorRT engine path ------------------------------------
# TensorRT-LLM deprecated (PR 11723, 2026-02) and then removed the TensorRT engine backend: examples with
# convert_checkpoint.py/trtllm-build (PR 15763), the C++ Triton backend `inflight_batcher_llm` (PR 15907),
# the Python modules (PR 15918). Release notes of v1.3.0rc20 (github NVIDIA/TensorRT-LLM releases/tag/
# v1.3.0rc20): "This RC version will be the last one supporting the TensorRT backend". That RC is not on
# PyPI (`pip index versions --pre tensorrt-llm` lists 1.3.0rc15, then rc22); the last *stable* release
# with the engine path is 1.2.1 (PyPI, 2026-04; its docs still ship commands/trtllm-build.html:
# NVIDIA/TensorRT-LLM gh-pages 1.2.1/commands/trtllm-build.html @58fb435e). specpipe pins 1.2.1.
TRTLLM_ENGINE_VERSION = "1.2.1"
TRTLLM_ENGINE_TAG = "v1.2.1"
TRTLLM_LAST_ENGINE_RC = "1.3.0rc20"  # GitHub/NGC only
# 11723 deprecation; 15763 examples (convert_checkpoint.py / trtllm-build trees), 15767 docs + migration guide
# (docs/source/legacy/tensorrt-backend-removal.md: "PyTorch is now the sole execution backend"), 15907 the C++
# Triton backend inflight_batcher_llm ("keeping only the PyTorch/LLM API Triton backend (all_models/llmapi)"),
# 15918 the Python engine modules (PR descriptions read on github.com/NVIDIA/TensorRT-LLM/pull/<n>).
TRTLLM_REMOVAL_PRS = (11723, 15763, 15767, 15907, 15918)

# ---- the LLM-API flow's TensorRT-LLM ----------------------------------------------------------------------
# Pinned: the newest 1.3.x tag found, v1.3.0rc26 (GitHub release page NVIDIA/TensorRT-LLM/releases/tag/v1.3.0rc26,
# "released this 09 Sep", commit c295dd9, = c295dd9fca "[https://nvbugs/6193837][fix] Include FINALIZE-fusion
# workspace ..." (#18675), 2026-09-04). No final v1.3.0 tag was found. Its docs are gh-pages 1.3.0rc26/ @f2bb6484.
# The full 40-hex commit of the tag could not be resolved from the stores this session could read (the
# repository is too large to fetch here); the source files below were read at the commits the code index
# holds, named next to each fact. Packaging orders 1.3.0rc26 before 1.3.0, so the pin is the rc itself.
TRTLLM_LLMAPI_VERSION = "1.3.0rc26"
TRTLLM_LLMAPI_TAG = "v1.3.0rc26"
TRTLLM_LLMAPI_COMMIT = "c295dd9fca"
TRTLLM_LLMAPI_MIN_VERSION = TRTLLM_LLMAPI_VERSION
# The engine flow's 1.2.1: PR 12755 "Bump version to 1.2.1" (2026-04); tensorrtllm_backend PR 853 tracks the
# release/1.2.1 branch. Its docs: gh-pages 1.2.1/ @58fb435e (full: 58fb435eacc402f3bd177e60f592c955d2b0719d).
# The tag's own commit was not resolvable here either.
TRTLLM_ENGINE_DOCS_COMMIT = "58fb435eacc402f3bd177e60f592c955d2b0719d"
LLMAPI_DOCS_COMMIT = "f2bb6484102a7e38bcd66df700a38dfe4a8de02d"
# Source files of the 1.3 line as read (code index versions; main-branch commits of the rc line).
LLM_ARGS_PY = "tensorrt_llm/llmapi/llm_args.py"
LLM_ARGS_COMMIT = "0004396720054fd8e205cbf616f21f0b57c6b412"
SPEC_UTILS_PY = "tensorrt_llm/_torch/speculative/utils.py"
SPEC_UTILS_COMMIT = "011d0933dcb5e592f5fa2626beaf42a96324c578"
SPEC_INTERFACE_PY = "tensorrt_llm/_torch/speculative/interface.py"
SPEC_INTERFACE_COMMIT = "00b6d5a25c30b4382d24fbdf52956d601b3ffd24"
# The matching Triton container ships tensorrtllm_backend and tritonserver; its version follows the
# TensorRT-LLM release (triton-inference-server/tensorrtllm_backend README, "Using the TensorRT-LLM Backend").

# ---- convert_checkpoint.py (LLaMA family) --------------------------------------------------------------
# NVIDIA/TensorRT-LLM examples/models/core/llama/convert_checkpoint.py (@368f8f2a, the 1.3 line; the
# flags used here are unchanged since 0.9): --model_dir, --output_dir, --dtype {auto,float16,bfloat16,
# float32}, --tp_size, --pp_size, --workers.
CONVERT_CHECKPOINT_LLAMA = "examples/models/core/llama/convert_checkpoint.py"
CONVERT_DTYPES = ("auto", "float16", "bfloat16", "float32")

# ---- quantize.py (ModelOpt PTQ) -------------------------------------------------------------------------
# NVIDIA/TensorRT-LLM examples/quantization/quantize.py (@059c97c1): --model_dir, --dtype {auto,float16,
# bfloat16,float32}, --qformat {nvfp4,fp8,int8_sq,int4_awq,w4a8_awq,int8_wo,int4_wo,full_prec},
# --kv_cache_dtype {int8,fp8}, --calib_size, --output_dir, --tp_size, --pp_size, --export_format
# {tensorrt_llm,hf}. The same qformat keys are in 1.2.1's quant_cfg_choices()
# (gh-pages 1.2.1/_modules/tensorrt_llm/quantization/quantize_by_modelopt.html @58fb435e).
QUANTIZE_SCRIPT = "examples/quantization/quantize.py"
QFORMATS = ("nvfp4", "fp8", "int8_sq", "int4_awq", "w4a8_awq", "int8_wo", "int4_wo", "full_prec")
QUANT_KV_CACHE_DTYPES = ("int8", "fp8")
# Defect 1 (issue 15): --export_format exists in some quantize.py versions (@059c97c1, passed on to
# quantize_and_export(export_format=...)) and not in others (@c8c6df08: no such argument, and
# quantize_and_export is called without it). The engine flow never passes it: a TensorRT-LLM checkpoint is
# what quantize.py writes by default in every version, so omitting the flag is right for all of them.
QUANTIZE_FLAGS_ENGINE_FLOW = ("--model_dir", "--dtype", "--qformat", "--kv_cache_dtype", "--calib_size", "--output_dir",
                              "--tp_size", "--pp_size")  # fmt: skip

# specpipe's --quant modes -> quantize.py --qformat. int4-wo maps to AWQ: ModelOpt's activation-aware
# int4 weight-only recipe (INT4_AWQ_CFG), the one TensorRT-LLM documents for int4 weights.
QFORMAT_FOR_MODE = {"fp8": "fp8", "int8": "int8_sq", "int8-wo": "int8_wo", "int4-wo": "int4_awq"}

# ---- trtllm-build ---------------------------------------------------------------------------------------
# gh-pages 1.2.1/commands/trtllm-build.html @58fb435e (the argparse usage of tensorrt_llm/commands/build.py
# in 1.2.1). Note: trtllm-build has no --tp_size; tensor parallelism is fixed when the checkpoint is
# converted or quantized (--tp_size there), and trtllm-build builds one rank{i}.engine per rank.
TRTLLM_BUILD = "trtllm-build"
SPECULATIVE_DECODING_MODES = ("draft_tokens_external", "lookahead_decoding", "medusa", "explicit_draft_tokens", "eagle")
GEMM_PLUGIN_CHOICES = ("auto", "float16", "float32", "bfloat16", "int32", "fp8", "nvfp4", "disable")
ENABLE_DISABLE = ("enable", "disable")
# Engine output: config.json + rank{rank}.engine (tensorrt_llm/builder.py, Engine.save / Engine.from_dir).
ENGINE_CONFIG_FILE = "config.json"


def engine_file(rank: int) -> str:
    return f"rank{rank}.engine"


# Defect 3 (issue 15): tensorrt_llm/builder.py build() (@14e801da, the engine line): when the model's
# quant_algo is not in [QuantAlgo.FP8, QuantAlgo.W4A8_AWQ, QuantAlgo.NVFP4] and the KV cache is fp8,
# "FP8 Paged Context FMHA is disabled because FP8 context FMHA is disabled": use_paged_context_fmha is
# silently turned off, and with it KV-cache reuse and chunked context. Of specpipe's modes only fp8 maps to
# one of those algorithms, so only an fp8 model keeps an fp8 KV cache on the engine flow.
FP8_KV_WEIGHT_QUANT = ("fp8",)
# Defect 4 (issue 15): cpp/tensorrt_llm/batch_manager/trtGptModel.h (@c8c6df08): with the executor's
# enable_chunked_context, "maxInputLen = maxSequenceLen - 1 since chunked context is enabled"; without it
# maxInputLen = min(maxSequenceLen - 1, maxNumTokens) and a longer request is refused. The BLS draft-target
# loop re-sends the whole sequence as a prompt each iteration, so both engines run with chunked context
# (which needs paged context FMHA, kept by the rule above).

# Draft-target with the C++ runtime needs KV-cache reuse, which needs paged context FMHA:
# examples/draft_target_model/README.md (@11925f62): "--use_paged_context_fmha=enable must be specified
# since we need KV-Cache reuse", "--speculative_decoding_mode=draft_tokens_external and --max_draft_len
# must be specified for target model". tensorrtllm_backend issue 271: enable_kv_cache_reuse without
# paged context FMHA fails at model load. TensorRT-LLM issue 2166: paged context FMHA does not support
# an int8 KV cache, so an int8 KV cache cannot be used on this path.

# ---- tensorrtllm_backend (Triton) -----------------------------------------------------------------------
# Model templates: NVIDIA/TensorRT-LLM triton_backend/all_models/inflight_batcher_llm/<model>/config.pbtxt
# (moved there from tensorrtllm_backend/all_models after v0.19). Parameter keys are the ones inside the
# config.pbtxt, not fill_template.py's variable names: ${engine_dir} fills key "gpt_model_path" and
# ${batching_strategy} fills key "gpt_model_type" (tensorrt_llm/config.pbtxt @0c8de69a).
TRITON_MODELS = ("ensemble", "preprocessing", "tensorrt_llm", "tensorrt_llm_draft", "tensorrt_llm_bls", "postprocessing")
TRITON_TEMPLATES_DIR = "triton_backend/all_models/inflight_batcher_llm"
TENSORRTLLM_BACKEND = "tensorrtllm"  # tensorrt_llm/config.pbtxt: backend "${triton_backend}" = tensorrtllm (docs/model_config.md)
BATCHING_STRATEGIES = ("inflight_fused_batching", "V1")  # docs/model_config.md, tensorrtllm_backend v1.0.0
# Python models whose model.py specpipe takes from the pinned checkout (never vendored).
# Defect 2 (issue 15): preprocessing/1/model.py (@01259b15) reads
# model_config['parameters']['multimodal_model_path']['string_value'] unguarded (a KeyError at load without
# it) and treats "" (or the unfilled "${multimodal_model_path}") as no multimodal model.
PREPROCESSING_REQUIRED_PARAMETERS = ("tokenizer_dir", "multimodal_model_path")
PYTHON_MODEL_FILES = {
    "preprocessing": ("1/model.py",),
    "postprocessing": ("1/model.py",),
    "tensorrt_llm_bls": ("1/model.py", "1/lib/decode.py", "1/lib/triton_decoder.py"),
}

# ---- LLM API path (the forward path after the removal) ---------------------------------------------------
# tensorrt_llm.llmapi.DraftTargetDecodingConfig: fields max_draft_len and speculative_model (alias
# speculative_model_dir); 1.2.1 dispatched a dict on decoding_type "DraftTarget", the pin on "Draft_Target" (below)
# (gh-pages 1.2.1/_modules/tensorrt_llm/llmapi/llm_args.html @58fb435e; DECODING_TYPES below). The 1.2.1 docs'
# draft-target example also passes disable_overlap_scheduler=True (1.2.1/features/speculative-decoding.html;
# not re-checked for 1.3: tests/test_gpu_llmapi.py validates the YAML with the installed TorchLlmArgs).
# Triton's llmapi model: triton_backend/all_models/llmapi/tensorrt_llm/1/model.yaml (@0ebb1536) is passed
# to LLM(**yaml) except `triton_config` ({max_batch_size, decoupled}); model.py reads it via
# update_llm_args_with_extra_dict (speculative_config -> DecodingBaseConfig.from_dict).
LLMAPI_TEMPLATES_DIR = "triton_backend/all_models/llmapi/tensorrt_llm"
LLMAPI_MODEL_FILES = ("1/model.py", "1/helpers.py")
# Defect 5 (issue 15): triton_backend/scripts/launch_triton_server.py (@0a2e2c1f) always passes
# --disable-auto-complete-config, so llmapi model.py's auto_complete_config (@044a90d2: set_model_transaction_
# policy(decoupled=triton_config["decoupled"]), set_max_batch_size(triton_config["max_batch_size"])) never
# runs: config.pbtxt must carry both values itself, equal to model.yaml's triton_config (model.py's initialize
# reads triton_config again and refuses streaming "Streaming is only supported in decoupled mode.").
LAUNCH_SCRIPT = "triton_backend/scripts/launch_triton_server.py"
LAUNCH_DISABLES_AUTO_COMPLETE = "--disable-auto-complete-config"
# The llmapi model's request tensors (config.pbtxt @0a710573): a client sends text_input, streaming and
# sampling_param_* and reads text_output plus the perf outputs, acceptance ones included.
LLMAPI_REQUEST_TENSORS = {
    "text_input": "STRING", "streaming": "BOOL", "sampling_param_temperature": "FP32", "sampling_param_top_k": "INT32",
    "sampling_param_top_p": "FP32", "sampling_param_max_tokens": "INT32", "sampling_param_stop": "STRING",
    "sampling_param_seed": "UINT64", "sampling_param_exclude_input_from_output": "BOOL",
    "sampling_param_return_perf_metrics": "BOOL", "sampling_param_frequency_penalty": "FP32",
    "sampling_param_presence_penalty": "FP32", "sampling_param_best_of": "INT32",
}  # fmt: skip

# LLM(...) arguments specpipe writes (tensorrt_llm/llmapi/llm_args.py BaseLlmArgs @fcd3f316; the same names
# on 2026 main): model, backend, tensor_parallel_size, pipeline_parallel_size, max_batch_size, max_num_tokens,
# max_seq_len, kv_cache_config (KvCacheConfig: free_gpu_memory_fraction, enable_block_reuse, dtype),
# enable_chunked_prefill, speculative_config.
LLM_ARGS = ("model", "backend", "tensor_parallel_size", "pipeline_parallel_size", "max_batch_size", "max_num_tokens",
            "max_seq_len", "kv_cache_config", "enable_chunked_prefill", "speculative_config", "disable_overlap_scheduler")  # fmt: skip
# speculative_config is a pydantic union picked by decoding_type (Field(discriminator="decoding_type")) at the pin:
# llm_args.py @00043967 `class DraftTargetDecodingConfig(DecodingBaseConfig): decoding_type: Literal["Draft_Target"]`,
# `Eagle3DecodingConfig(EagleDecodingConfig): decoding_type: Literal["Eagle3"]`, `NGramDecodingConfig: Literal["NGram"]`.
# 1.2.1 and older dispatched through DecodingBaseConfig.from_dict with "DraftTarget" (gh-pages 1.2.1 llm_args.html);
# the engine flow writes no speculative_config, so only the 1.3 spelling is emitted.
DECODING_TYPES = {"draft_target": "Draft_Target", "eagle3": "Eagle3", "ngram": "NGram"}
# DecodingBaseConfig fields specpipe may write (llm_args.py @00043967). The acceptance gate was renamed from
# acceptance_window / acceptance_length_threshold (1.2.x) to acceptance_rate_window_size / acceptance_rate_threshold
# (py_executor reads `getattr(spec_config, 'acceptance_rate_window_size', None)`); specpipe writes neither today.
DECODING_BASE_FIELDS = ("max_draft_len", "speculative_model", "max_concurrency", "draft_len_schedule",
                        "acceptance_rate_window_size", "acceptance_rate_threshold")  # fmt: skip
# draft_len_schedule at the pin (utils.py @011d0933 get_draft_len_for_batch_size): "Keys represent specific batch
# sizes (transition points). Values represent draft_len to use for batch sizes UP TO that key"; above the largest
# key the draft length is min_draft_len (0 unless the algorithm needs a floor). 1.2.x read a key as "batch size
# >= key" (drafter.py bisect_right). Which modes honour it: interface.py @00b6d5a2 support_dynamic_draft_len() =
# mtp_one_model, eagle3_one_model, mtp_eagle_one_model, pard, dflash, draft_target_one_model, sa: not NGram and
# not the two-model DRAFT_TARGET. max_concurrency ("speculation will be disabled at batch sizes above this
# value") holds for every drafter.
SCHEDULE_MODES = ("eagle3",)
# EagleDecodingConfig.eagle3_layers_to_capture: Optional[Set[int]] (llm_args.py @00043967; "Defaults to {1,
# num_layers//2-1, num_layers-4}"), read by utils.py get_spec_metadata as layers_to_capture for the Eagle3 modes.
EAGLE3_LAYERS_KEY = "eagle3_layers_to_capture"
# The head's own format (architecture, captured-layer key, tensor names) is a checkpoint fact: checkpoint/eagle3.py.

# Quantization the PyTorch backend runs (docs/source/features/quantization.md, gh-pages 1.3.0rc27/features/
# quantization.html: "The default PyTorch backend supports FP4 and FP8 quantization"; recipes FP8, NVFP4,
# W4A16 AWQ/GPTQ, W4A8 AWQ/GPTQ, FP8 and NVFP4 KV cache; no INT8 SmoothQuant, INT8 weight-only or INT8 KV).
# specpipe's modes it can take (defect 6): fp8 and int4-wo (W4A16 AWQ); KV cache auto or fp8.
LLMAPI_QUANT_MODES = ("none", "fp8", "int4-wo")
LLMAPI_KV_CACHE_DTYPES = ("auto", "fp8")

# ModelOpt PTQ for the PyTorch backend: NVIDIA/Model-Optimizer examples/llm_ptq/hf_ptq.py (@003e0fba):
# --pyt_ckpt_path (alias --model), --qformat (QUANT_CFG_CHOICES: fp8, int4_awq, nvfp4, int8_sq, ...),
# --kv_cache_qformat {none, fp8_cast, fp8, ...} (default fp8_cast: pass none for an unquantized KV cache),
# --calib_size, --export_path, --inference_tensor_parallel; it always exports a unified Hugging Face
# checkpoint (--export_fmt "Deprecated ... forced to hf"). The TensorRT-LLM docs point there for offline
# quantization (torch/features/quantization.html: examples/llm_ptq ... --export_fmt hf).
MODELOPT_PTQ_SCRIPT = "examples/llm_ptq/hf_ptq.py"
MODELOPT_PTQ_FLAGS = ("--pyt_ckpt_path", "--qformat", "--kv_cache_qformat", "--calib_size", "--export_path",
                      "--inference_tensor_parallel")  # fmt: skip
MODELOPT_QFORMAT_FOR_MODE = {"fp8": "fp8", "int4-wo": "int4_awq"}
MODELOPT_KV_QFORMAT = {"auto": "none", "fp8": "fp8"}

# trtllm-serve (tensorrt_llm/commands/serve.py): `trtllm-serve <model> --extra_llm_api_options <yaml>`
# (the flag is an alias of --config on 2026 main: "Explicit CLI flags take precedence over values in this file").
TRTLLM_SERVE = "trtllm-serve"
TRTLLM_SERVE_CONFIG_FLAG = "--extra_llm_api_options"

# ---- TensorRT (the tensorrt backend) --------------------------------------------------------------------
# Python API checked in NVIDIA/TensorRT python/src/infer/pyCore.cpp @a892d222 (TensorRT 11.1 OSS):
# Builder.create_network(flags), NetworkDefinitionCreationFlag.STRONGLY_TYPED ("Deprecated: always
# enabled" in 11.x, required on 10.x for QDQ fp8), Builder.create_builder_config /
# create_optimization_profile / build_serialized_network, IOptimizationProfile.set_shape(input, min, opt,
# max), IBuilderConfig.add_optimization_profile / set_memory_pool_limit(MemoryPoolType.WORKSPACE, n),
# Runtime.deserialize_cuda_engine, ICudaEngine.create_execution_context / num_io_tensors /
# get_tensor_name / get_tensor_mode / get_tensor_dtype / get_tensor_profile_shape(name, profile_index),
# IExecutionContext.set_optimization_profile_async(profile_index, stream_handle) / set_input_shape /
# get_tensor_shape / set_tensor_address / execute_async_v3(stream_handle); python/src/parsers/pyOnnx.cpp:
# OnnxParser.parse_from_file / num_errors / get_error.
# TensorRT 11 removed BuilderFlag.FP16/BF16/INT8/FP8: precision must be in the graph (docs.nvidia.com
# tensorrt 11.x "Migrating Python Code from TensorRT 10.x to 11.x"): fp16/bf16 through ModelOpt AutoCast
# (modelopt.onnx.autocast.convert_to_mixed_precision(onnx_path, low_precision_type, keep_io_types, ...)
# -> onnx.ModelProto), int8/fp8 through Q/DQ nodes, which specpipe's quantizer writes.
TENSORRT_MIN_VERSION = "10.12"  # strongly typed networks with fp8 Q/DQ; weak typing deprecated in 10.12
AUTOCAST_LOW_PRECISION = {"float16": "fp16", "bfloat16": "bf16"}


# ---- the table: every tag, key and flag specpipe writes, read once -------------------------------------------
# tests/test_upstream_table.py builds llama-70b + llama-7b (and an EAGLE-3 head) dry and checks every emitted
# model.yaml key, decoding_type, trtllm-build flag and config.pbtxt parameter against this table.
from dataclasses import dataclass  # noqa: E402


@dataclass(frozen=True)
class Fact:
    """One name specpipe writes: where it goes, its value where the value is fixed, and where it was read."""

    where: str  # model.yaml | speculative_config | decoding_type | trtllm-build | config.pbtxt:<model>
    key: str
    value: object = None  # None: the key is fixed, the value is the build's
    path: str = ""
    commit: str = ""


_ARGS = (LLM_ARGS_PY, LLM_ARGS_COMMIT)
_BUILD = ("gh-pages 1.2.1/commands/trtllm-build.html", TRTLLM_ENGINE_DOCS_COMMIT)
_LLMAPI_MODEL = ("triton_backend/all_models/llmapi/tensorrt_llm/1/model.yaml", "0ebb1536")
_PBTXT = ("triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt", "0c8de69a")

FACTS: tuple[Fact, ...] = (
    *(Fact("model.yaml", k, None, *_ARGS) for k in LLM_ARGS),
    Fact("model.yaml", "triton_config", None, *_LLMAPI_MODEL),
    Fact("kv_cache_config", "free_gpu_memory_fraction", None, *_ARGS),
    Fact("kv_cache_config", "enable_block_reuse", None, *_ARGS),
    Fact("kv_cache_config", "dtype", None, *_ARGS),
    Fact("decoding_type", "draft_target", DECODING_TYPES["draft_target"], *_ARGS),
    Fact("decoding_type", "eagle3", DECODING_TYPES["eagle3"], *_ARGS),
    Fact("decoding_type", "ngram", DECODING_TYPES["ngram"], *_ARGS),
    *(Fact("speculative_config", k, None, *_ARGS) for k in DECODING_BASE_FIELDS),
    Fact("speculative_config", "decoding_type", None, *_ARGS),
    Fact("speculative_config", "max_matching_ngram_size", None, *_ARGS),
    Fact("speculative_config", EAGLE3_LAYERS_KEY, None, *_ARGS),
    Fact("draft_len_schedule", "semantics", "up_to_key", SPEC_UTILS_PY, SPEC_UTILS_COMMIT),
    Fact("trtllm-build", "--checkpoint_dir", None, *_BUILD),
    Fact("trtllm-build", "--output_dir", None, *_BUILD),
    Fact("trtllm-build", "--gemm_plugin", "auto", *_BUILD),
    Fact("trtllm-build", "--use_paged_context_fmha", "enable", *_BUILD),
    Fact("trtllm-build", "--max_batch_size", None, *_BUILD),
    Fact("trtllm-build", "--max_input_len", None, *_BUILD),
    Fact("trtllm-build", "--max_seq_len", None, *_BUILD),
    Fact("trtllm-build", "--max_num_tokens", None, *_BUILD),
    Fact("trtllm-build", "--gather_generation_logits", None, *_BUILD),
    Fact("trtllm-build", "--workers", None, *_BUILD),
    Fact("trtllm-build", "--speculative_decoding_mode", "draft_tokens_external", *_BUILD),
    Fact("trtllm-build", "--max_draft_len", None, *_BUILD),
    Fact("config.pbtxt:tensorrt_llm", "gpt_model_path", None, *_PBTXT),
    Fact("config.pbtxt:tensorrt_llm", "gpt_model_type", "inflight_fused_batching", *_PBTXT),
)


def facts(where: str) -> dict[str, object]:
    """The table's keys for one destination, each with its fixed value (None where the build chooses it)."""
    return {f.key: f.value for f in FACTS if f.where == where}
