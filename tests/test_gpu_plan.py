"""GPU plans and the TensorRT-LLM Triton repository, checked against what upstream expects (no GPU needed).

The expectations below are copied from the upstream files named next to them, independently of
specpipe/engines/upstream.py: if someone edits a flag there, these tests fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specpipe.builder import GpuMemoryError, make_plan, render_plan, write_plan_repository
from specpipe.builder.config import BuildConfig
from specpipe.builder.memory import GB, kv_bytes_per_token
from specpipe.checkpoint.facts import resolve_shape, shape_from_config
from specpipe.config import make_config
from specpipe.engines.tensorrt_build import optimization_profiles, select_profile
from specpipe.errors import IncompatiblePairError, UsageError
from specpipe.triton.model_config import parse_config, read_config
from specpipe.triton.trtllm_repo import compare_with_templates, parse_template

# trtllm-build flags in TensorRT-LLM 1.2.1 (gh-pages 1.2.1/commands/trtllm-build.html @58fb435e), the
# subset a plan may use, with the choices of the ones that take a fixed set.
TRTLLM_BUILD_FLAGS = {
    "--checkpoint_dir", "--output_dir", "--max_batch_size", "--max_input_len", "--max_seq_len", "--max_num_tokens",
    "--gemm_plugin", "--use_paged_context_fmha", "--use_fp8_context_fmha", "--speculative_decoding_mode",
    "--max_draft_len", "--gather_generation_logits", "--workers", "--kv_cache_type", "--remove_input_padding",
}  # fmt: skip
BUILD_CHOICES = {
    "--gemm_plugin": {"auto", "float16", "float32", "bfloat16", "int32", "fp8", "nvfp4", "disable"},
    "--use_paged_context_fmha": {"enable", "disable"},
    "--speculative_decoding_mode": {"draft_tokens_external", "lookahead_decoding", "medusa", "explicit_draft_tokens", "eagle"},
}
# examples/quantization/quantize.py (@059c97c1)
QUANTIZE_FLAGS = {
    "--model_dir", "--dtype", "--qformat", "--kv_cache_dtype", "--calib_size", "--output_dir", "--tp_size", "--pp_size",
    "--export_format", "--calib_dataset", "--batch_size", "--awq_block_size",
}  # fmt: skip
QUANTIZE_CHOICES = {
    "--qformat": {"nvfp4", "fp8", "int8_sq", "int4_awq", "w4a8_awq", "int8_wo", "int4_wo", "full_prec"},
    "--kv_cache_dtype": {"int8", "fp8"},
    "--dtype": {"auto", "float16", "bfloat16", "float32"},
    "--export_format": {"tensorrt_llm", "hf"},
}
# examples/models/core/llama/convert_checkpoint.py (@368f8f2a)
CONVERT_FLAGS = {"--model_dir", "--output_dir", "--dtype", "--tp_size", "--pp_size", "--workers", "--fp8_kv_cache"}
# Parameter keys of triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt (@0c8de69a)
TENSORRT_LLM_PARAMETER_KEYS = {
    "max_beam_width", "FORCE_CPU_ONLY_INPUT_TENSORS", "gpt_model_type", "gpt_model_path", "encoder_model_path",
    "max_tokens_in_paged_kv_cache", "max_attention_window_size", "sink_token_length", "batch_scheduler_policy",
    "kv_cache_free_gpu_mem_fraction", "cross_kv_cache_fraction", "kv_cache_host_memory_bytes", "kv_cache_onboard_blocks",
    "enable_trt_overlap", "exclude_input_in_output", "cancellation_check_period_ms", "stats_check_period_ms",
    "iter_stats_max_iterations", "request_stats_max_iterations", "enable_kv_cache_reuse", "normalize_log_probs",
    "enable_chunked_context", "gpu_device_ids", "participant_ids", "num_nodes", "lora_cache_optimal_adapter_size",
    "lora_cache_max_adapter_size", "lora_cache_gpu_memory_fraction", "lora_cache_host_memory_bytes", "lora_prefetch_dir",
    "decoding_mode", "executor_worker_path", "lookahead_window_size", "lookahead_ngram_size",
    "lookahead_verification_set_size", "medusa_choices", "eagle_choices", "gpu_weights_percent",
    "enable_context_fmha_fp32_acc", "multi_block_mode", "cuda_graph_mode", "cuda_graph_cache_size",
    "speculative_decoding_fast_logits", "tokenizer_dir", "guided_decoding_backend", "xgrammar_tokenizer_info_path",
}  # fmt: skip
# tensorrt_llm_bls/config.pbtxt (@0193dbd4), preprocessing (@08dc37e3), postprocessing (@89fd9b74)
BLS_PARAMETER_KEYS = {"accumulate_tokens", "tensorrt_llm_model_name", "tensorrt_llm_draft_model_name", "multimodal_encoders_name"}
PRE_PARAMETER_KEYS = {"tokenizer_dir", "add_special_tokens", "multimodal_model_path", "gpt_model_path", "max_num_images", "hf_model_path"}
POST_PARAMETER_KEYS = {"tokenizer_dir", "skip_special_tokens"}
# docs/model_config.md (tensorrtllm_backend v1.0.0): batching_strategy values
BATCHING = {"inflight_fused_batching", "V1"}

# NVIDIA/TensorRT-LLM examples/quantization/quantize.py @c8c6df08: the argparse flags (no --export_format)
QUANTIZE_FLAGS_C8C6DF08 = QUANTIZE_FLAGS - {"--export_format"}
# NVIDIA/Model-Optimizer examples/llm_ptq/hf_ptq.py @003e0fba: the flags and choices a plan may use
HF_PTQ_FLAGS = {"--pyt_ckpt_path", "--qformat", "--kv_cache_qformat", "--calib_size", "--export_path", "--inference_tensor_parallel",
                "--dataset", "--batch_size"}  # fmt: skip
HF_PTQ_QFORMATS = {"int8", "int8_sq", "int8_wo", "fp8", "int4_awq", "w4a8_awq", "nvfp4", "nvfp4_awq"}
HF_PTQ_KV_QFORMATS = {"none", "fp8_cast", "fp8", "fp8_affine", "nvfp4_cast", "nvfp4", "nvfp4_affine", "nvfp4_rotate"}
# tensorrt_llm/llmapi/llm_args.py: BaseLlmArgs fields (@fcd3f316) and DecodingBaseConfig fields (2026 main)
LLM_ARGS = {"model", "backend", "tensor_parallel_size", "pipeline_parallel_size", "max_batch_size", "max_num_tokens", "max_seq_len",
            "max_input_len", "kv_cache_config", "enable_chunked_prefill", "speculative_config", "disable_overlap_scheduler"}  # fmt: skip
# llm_args.py @00043967 (v1.3.0rc26 line): the acceptance gate was renamed from acceptance_window / acceptance_length_threshold
DECODING_BASE_FIELDS = {"max_draft_len", "max_total_draft_tokens", "speculative_model", "max_concurrency", "draft_len_schedule",
                        "load_format", "acceptance_rate_window_size", "acceptance_rate_threshold", "allow_advanced_sampling"}  # fmt: skip
# triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt @0a710573: what an llmapi client sends
LLMAPI_CLIENT_TENSORS = {"text_input": "STRING", "streaming": "BOOL", "sampling_param_temperature": "FP32",
                         "sampling_param_top_k": "INT32", "sampling_param_top_p": "FP32", "sampling_param_max_tokens": "INT32",
                         "sampling_param_seed": "UINT64", "sampling_param_stop": "STRING"}  # fmt: skip

SIX_MODELS = {"ensemble", "preprocessing", "tensorrt_llm", "tensorrt_llm_draft", "tensorrt_llm_bls", "postprocessing"}


def _cfg(tmp_path: Path, **kw) -> BuildConfig:
    """A GPU build as the command line gives it: --backend (trtllm here) and its options, --quant, --draft-quant and
    --kv-cache-dtype (one for both models), the rest BuildConfig's own."""
    options = dict(target="llama-70b", draft="llama-7b", engines_dir=tmp_path / "engines", repo_dir=tmp_path / "repo",
                   backend="trtllm", dry_run=True) | kw
    kv = options.pop("kv_cache_dtype", "auto")
    quant = {"quant": {"mode": options.pop("quant", "none"), "kv_cache_dtype": kv},
             "draft_quant": {"mode": options.pop("draft_quant", "none"), "kv_cache_dtype": kv}}
    backend = {"kind": options.pop("backend")} | {k: options.pop(k) for k in list(options) if k not in BuildConfig.model_fields}
    return make_config(BuildConfig, **options, **quant, backend=backend)


def _engine_cfg(tmp_path: Path, **kw) -> BuildConfig:
    """The TensorRT-LLM 1.2.1 engine flow (--trtllm-flow engine)."""
    return _cfg(tmp_path, trtllm_flow="engine", **kw)


def _flags(argv: tuple[str, ...]) -> dict[str, str | None]:
    """--flag value pairs (a flag followed by another flag, or last, has no value)."""
    flags, items = {}, list(argv)
    for i, item in enumerate(items):
        if item.startswith("--"):
            nxt = items[i + 1] if i + 1 < len(items) else None
            flags[item] = None if nxt is None or nxt.startswith("--") else nxt
    return flags


def _step(plan, step_id: str):
    (step,) = [s for s in plan.steps if s.id == step_id]
    return step


# ---- 70B + 7B with TensorRT-LLM ---------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [4, 8])
def test_llama_70b_7b_fp8_plan_uses_upstream_flags(tmp_path, tp):
    plan = make_plan(_engine_cfg(tmp_path, quant="fp8", tp_size=tp, kv_cache_dtype="fp8"))
    assert plan.versions["tensorrt_llm"] == "1.2.1"

    quantize = _flags(_step(plan, "target.quantize").argv)
    assert set(quantize) <= QUANTIZE_FLAGS
    assert quantize["--qformat"] == "fp8" and quantize["--kv_cache_dtype"] == "fp8"
    assert quantize["--tp_size"] == str(tp)
    for flag, allowed in QUANTIZE_CHOICES.items():
        assert quantize.get(flag) in allowed | {None}

    # the draft is not quantized: an fp8 KV cache would turn its paged context FMHA off (defect 3), so it keeps
    # an fp16 one and is converted, not quantized
    assert plan.draft.kv_cache_dtype == "auto" and plan.target.kv_cache_dtype == "fp8"
    assert _flags(_step(plan, "draft.checkpoint").argv)["--tp_size"] == "1"

    for role in ("target", "draft"):
        step = _step(plan, f"{role}.engine")
        assert step.argv[0] == "trtllm-build" and step.gpu
        flags = _flags(step.argv)
        assert set(flags) <= TRTLLM_BUILD_FLAGS, set(flags) - TRTLLM_BUILD_FLAGS
        assert "--tp_size" not in flags  # trtllm-build has none: tp comes from the checkpoint
        for flag, allowed in BUILD_CHOICES.items():
            assert flags.get(flag) in allowed | {None}
        assert flags["--use_paged_context_fmha"] == "enable"  # draft_target_model/README.md: needed for KV reuse
    target_flags = _flags(_step(plan, "target.engine").argv)
    assert target_flags["--speculative_decoding_mode"] == "draft_tokens_external"
    assert target_flags["--max_draft_len"] == "8"
    assert "--speculative_decoding_mode" not in _flags(_step(plan, "draft.engine").argv)
    # trtllm-build writes config.json and one rank{i}.engine per rank (tensorrt_llm/builder.py Engine.save)
    engine_files = {Path(p).name for p in _step(plan, "target.engine").writes}
    assert engine_files == {"config.json"} | {f"rank{r}.engine" for r in range(tp)}
    assert plan.target.gpus == tuple(range(tp)) and plan.draft.gpus == (0,)
    # nothing GPU-side runs before the pair is resolved on the CPU
    first_gpu = next(i for i, s in enumerate(plan.steps) if s.gpu)
    assert {s.id for s in plan.steps[:first_gpu]} == {"target.resolve", "draft.resolve", "tokenizer"}


def test_unquantized_plan_converts_with_convert_checkpoint(tmp_path):
    plan = make_plan(_engine_cfg(tmp_path, tp_size=8))
    step = _step(plan, "target.checkpoint")
    assert step.argv[1].endswith("examples/models/core/llama/convert_checkpoint.py")
    flags = _flags(step.argv)
    assert set(flags) <= CONVERT_FLAGS and flags["--tp_size"] == "8" and flags["--dtype"] == "float16"


@pytest.mark.parametrize("quant, qformat", [("fp8", "fp8"), ("int8", "int8_sq"), ("int4-wo", "int4_awq"), ("int8-wo", "int8_wo")])
def test_quant_modes_map_to_modelopt_qformats(tmp_path, quant, qformat):
    plan = make_plan(_engine_cfg(tmp_path, quant=quant, tp_size=8))
    assert _flags(_step(plan, "target.quantize").argv)["--qformat"] == qformat


def test_memory_estimate_70b_fp8(tmp_path):
    plan = make_plan(_engine_cfg(tmp_path, quant="fp8", tp_size=8, kv_cache_dtype="fp8"))
    target = plan.memory.target
    assert 65 < target.weights_total_gb < 75  # ~70 GB: 1 byte per linear weight + fp16 embedding and lm_head
    embedding_gb = 32000 * 8192 * 2 / GB
    assert target.weights_gb == pytest.approx((target.weights_total_gb - embedding_gb) / 8 + embedding_gb, rel=1e-9)
    # KV: 2 x 80 layers x (8 KV heads / 8 ranks) x 128 x 1 byte
    assert target.kv_bytes_per_token == 2 * 80 * 1 * 128 * 1
    assert target.kv_tokens == 8 * 4096  # max_batch_size x max_seq_len (Llama 2 context)
    fp16 = make_plan(_engine_cfg(tmp_path, tp_size=8)).memory.target
    assert 130 < fp16.weights_total_gb < 145
    # GPU 0 holds a target rank and the whole draft; the other GPUs one target rank each
    gpu0, gpu1 = plan.memory.gpus[0], plan.memory.gpus[1]
    assert gpu0.weights_gb == pytest.approx(target.weights_gb + plan.memory.draft.weights_gb)
    assert gpu1.total_gb < gpu0.total_gb and len(plan.memory.gpus) == 8


def test_kv_heads_replicate_beyond_their_count():
    llama70 = resolve_shape("llama-70b")  # 8 KV heads
    assert kv_bytes_per_token(llama70, "auto", 8) == kv_bytes_per_token(llama70, "auto", 16) == 2 * 80 * 128 * 2


def test_tp_suggestion_for_gpu_memory(tmp_path):
    fp8 = dict(quant="fp8", draft_quant="fp8", kv_cache_dtype="fp8", trtllm_flow="engine")
    with pytest.raises(GpuMemoryError) as err:
        make_plan(_cfg(tmp_path, tp_size=1, gpu_memory_gb=80, **fp8))
    assert err.value.suggested_tp == 2 and "--tp-size 2" in str(err.value) and err.value.peak_gb > 80
    assert make_plan(_cfg(tmp_path, tp_size=2, gpu_memory_gb=80, **fp8)).memory.fits
    plan = make_plan(_cfg(tmp_path, tp_size=8, gpu_memory_gb=80, **fp8))
    assert plan.memory.fits and any("--tp-size 2 would also fit" in n for n in plan.notes)
    # 24 GB GPUs: the draft sharing GPU 0 is what does not fit; its own GPU does
    with pytest.raises(GpuMemoryError, match="--draft-placement separate --tp-size 4"):
        make_plan(_cfg(tmp_path, tp_size=2, gpu_memory_gb=24, **fp8))
    with pytest.raises(GpuMemoryError) as err:
        make_plan(_cfg(tmp_path, tp_size=8, gpu_memory_gb=8, **fp8))
    assert err.value.suggested_tp is None and "no --tp-size up to 8 fits" in str(err.value)


def test_bad_requests_are_refused(tmp_path):
    with pytest.raises(UsageError, match="2166"):  # int8 KV cache + paged context FMHA
        make_plan(_engine_cfg(tmp_path, kv_cache_dtype="int8", tp_size=8))
    with pytest.raises(UsageError, match="attention heads do not split over 3"):
        make_plan(_cfg(tmp_path, tp_size=3))
    with pytest.raises(IncompatiblePairError):  # Llama 2 and Llama 3 tokenizers differ
        make_plan(_cfg(tmp_path, draft="llama-3.1-8b", tp_size=8))
    with pytest.raises(UsageError, match="neither a known alias"):
        make_plan(_cfg(tmp_path, target=str(tmp_path / "nowhere")))


# ---- the tensorrtllm_backend repository ------------------------------------------------------------------


def _written_repo(tmp_path, **kw):
    cfg = _engine_cfg(tmp_path, quant="fp8", tp_size=8, kv_cache_dtype="fp8", **kw)
    plan = make_plan(cfg)
    written = write_plan_repository(plan, cfg)
    return plan, {p.parent.name: read_config(p.parent) for p in written if p.name == "config.pbtxt"}


def test_repository_models_and_parameters(tmp_path):
    plan, configs = _written_repo(tmp_path)
    assert set(configs) == SIX_MODELS
    for name, config in configs.items():
        assert config.name == name
    llm, draft = configs["tensorrt_llm"], configs["tensorrt_llm_draft"]
    for config, job in ((llm, plan.target), (draft, plan.draft)):
        params = {k: v.string_value for k, v in config.parameters.items()}
        assert set(params) <= TENSORRT_LLM_PARAMETER_KEYS, set(params) - TENSORRT_LLM_PARAMETER_KEYS
        assert config.backend == "tensorrtllm"
        assert params["gpt_model_path"] == str(Path(job.artifacts).absolute())
        assert params["gpt_model_type"] in BATCHING
        assert 0 < float(params["kv_cache_free_gpu_mem_fraction"]) <= 1
        assert params["enable_kv_cache_reuse"] == "true"
        assert params["gpu_device_ids"] == ",".join(map(str, job.gpus))
        assert not config.model_transaction_policy.decoupled  # the BLS calls both without streaming
    bls = configs["tensorrt_llm_bls"]
    params = {k: v.string_value for k, v in bls.parameters.items()}
    assert set(params) <= BLS_PARAMETER_KEYS
    assert params["tensorrt_llm_model_name"] == "tensorrt_llm"
    assert params["tensorrt_llm_draft_model_name"] == "tensorrt_llm_draft"
    assert set(configs["preprocessing"].parameters) <= PRE_PARAMETER_KEYS
    assert set(configs["postprocessing"].parameters) <= POST_PARAMETER_KEYS
    assert configs["ensemble"].platform == "ensemble"


def test_bls_speaks_the_client_protocol(tmp_path):
    _, configs = _written_repo(tmp_path)
    from tritonclient.grpc import model_config_pb2 as mc

    def types(tensors):
        return {t.name: mc.DataType.Name(t.data_type) for t in tensors}

    inputs, outputs = types(configs["tensorrt_llm_bls"].input), types(configs["tensorrt_llm_bls"].output)
    expected_inputs = {
        "text_input": "TYPE_STRING", "max_tokens": "TYPE_INT32", "stream": "TYPE_BOOL", "temperature": "TYPE_FP32",
        "top_p": "TYPE_FP32", "top_k": "TYPE_INT32", "end_id": "TYPE_INT32", "stop_words": "TYPE_STRING",
        "num_draft_tokens": "TYPE_INT32", "return_perf_metrics": "TYPE_BOOL", "use_draft_logits": "TYPE_BOOL",
    }  # fmt: skip
    assert {k: inputs[k] for k in expected_inputs} == expected_inputs
    expected_outputs = {
        "text_output": "TYPE_STRING", "acceptance_rate": "TYPE_FP32",
        "total_accepted_draft_tokens": "TYPE_INT32", "total_draft_tokens": "TYPE_INT32",
    }  # fmt: skip
    assert {k: outputs[k] for k in expected_outputs} == expected_outputs
    ensemble_inputs = types(configs["ensemble"].input)
    assert ensemble_inputs["text_input"] == "TYPE_STRING" and ensemble_inputs["max_tokens"] == "TYPE_INT32"


def test_ensemble_wiring_is_consistent(tmp_path):
    """Every mapped tensor exists on the composing model, and every ensemble tensor has a producer."""
    _, configs = _written_repo(tmp_path)
    ensemble = configs["ensemble"]
    produced = {t.name for t in ensemble.input}
    for step in ensemble.ensemble_scheduling.step:
        model = configs[step.model_name]
        model_inputs, model_outputs = {t.name for t in model.input}, {t.name for t in model.output}
        assert set(step.input_map) <= model_inputs, set(step.input_map) - model_inputs
        assert set(step.input_map.values()) <= produced, set(step.input_map.values()) - produced
        required = {t.name for t in model.input if not t.optional}
        assert required <= set(step.input_map), required - set(step.input_map)
        assert set(step.output_map) <= model_outputs
        produced |= set(step.output_map.values())
    assert {t.name for t in ensemble.output} <= produced


def test_template_comparison_catches_drift(tmp_path):
    """The drift check parses a fill_template-style template and names a renamed tensor."""
    template = (
        'name: "tensorrt_llm_bls"\nbackend: "python"\nmax_batch_size: ${triton_max_batch_size}\n'
        "model_transaction_policy {\n  decoupled: ${decoupled_mode}\n}\n"
        'input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },\n'
        '        { name: "random_seed" data_type: TYPE_UINT64 dims: [ 1 ] optional: true } ]\n'
        'output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] },\n'
        '         { name: "context_logits" data_type: ${logits_datatype} dims: [ -1, -1 ] } ]\n'
        'parameters: { key: "tensorrt_llm_model_name" value: { string_value: "${tensorrt_llm_model_name}" } }\n'
        "instance_group [ { count: ${bls_instance_count} kind : KIND_CPU } ]\n"
    )
    parsed = parse_template(template)
    assert parsed.max_batch_size == 1 and parsed.parameters["tensorrt_llm_model_name"].string_value == "${tensorrt_llm_model_name}"
    (tmp_path / "tensorrt_llm_bls").mkdir()
    (tmp_path / "tensorrt_llm_bls" / "config.pbtxt").write_text(template)
    from specpipe.triton.model_config import ModelSpec
    from specpipe.triton.trtllm_repo import BLS_INPUTS, TEXT_OUTPUTS

    outputs = tuple(t for t in TEXT_OUTPUTS if t.name in ("text_output", "context_logits"))
    bls = ModelSpec(name="tensorrt_llm_bls", backend="python", max_batch_size=8, inputs=BLS_INPUTS[:1], outputs=outputs)
    problems = compare_with_templates([bls], tmp_path)
    assert problems == ["tensorrt_llm_bls: input 'random_seed' is only in upstream's config"]


def test_llmapi_flow_writes_model_yaml(tmp_path):
    cfg = _cfg(tmp_path, quant="fp8", tp_size=8, kv_cache_dtype="fp8")
    plan = make_plan(cfg)
    assert plan.flow == "llmapi" and plan.versions["tensorrt_llm"].startswith("1.3.0rc26 (v1.3.0rc26 @c295dd9fca")
    assert not any(s.argv and s.argv[0] == "trtllm-build" for s in plan.steps)  # no engine build on this path
    ptq = _step(plan, "target.quantize")
    assert ptq.argv[1].endswith("examples/llm_ptq/hf_ptq.py")
    flags = _flags(ptq.argv)
    assert set(flags) <= HF_PTQ_FLAGS, set(flags) - HF_PTQ_FLAGS
    assert flags["--qformat"] == "fp8" and flags["--kv_cache_qformat"] == "fp8" and flags["--inference_tensor_parallel"] == "8"
    assert "draft.quantize" not in {s.id for s in plan.steps}  # fp16 draft: the KV dtype is a runtime setting here
    assert plan.draft.tp == 8 and plan.draft.gpus == plan.target.gpus  # the draft runs inside the target's LLM

    written = write_plan_repository(plan, cfg)
    model_yaml = yaml.safe_load((tmp_path / "repo" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert set(model_yaml) - {"triton_config"} <= LLM_ARGS, set(model_yaml) - LLM_ARGS
    assert model_yaml["backend"] == "pytorch" and model_yaml["tensor_parallel_size"] == 8 and model_yaml["max_batch_size"] == 8
    assert model_yaml["speculative_config"] == {
        "decoding_type": "Draft_Target", "max_draft_len": 8, "speculative_model": str(Path(plan.draft.artifacts).absolute()),
    }  # fmt: skip  (two-model DRAFT_TARGET takes no draft_len_schedule at v1.3.0rc26; the plan never reaches 0 at batch 8)
    assert set(model_yaml["speculative_config"]) - {"decoding_type"} <= DECODING_BASE_FIELDS
    assert model_yaml["triton_config"] == {"max_batch_size": 0, "decoupled": True}
    assert model_yaml["kv_cache_config"]["dtype"] == "fp8"
    serve = yaml.safe_load((tmp_path / "engines" / plan.name / "trtllm-serve.yaml").read_text())
    assert serve == {k: v for k, v in model_yaml.items() if k not in ("model", "triton_config")}  # one set of LLM arguments
    assert any(n.startswith("without Triton: trtllm-serve ") and "--extra_llm_api_options" in n for n in plan.notes)
    config = parse_config((tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").read_text())
    assert config.backend == "python"
    assert {"text_input", "sampling_param_max_tokens", "streaming"} <= {t.name for t in config.input}
    assert len(written) == 3


def test_cli_plans_the_llmapi_flow_by_default(tmp_path):
    args = ["build", "--target", "llama-70b", "--draft", "llama-7b", "--backend", "trtllm", "--dry-run",
            "--repo-dir", str(tmp_path / "repo"), "--engines-dir", str(tmp_path / "engines")]  # fmt: skip
    result = _specpipe(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "flow llmapi" in result.stdout and "trtllm-build" not in result.stdout and "draft_len_schedule" in result.stdout
    assert {p.name for p in (tmp_path / "repo").iterdir()} == {"tensorrt_llm"}
    engine = _specpipe(*args, "--trtllm-flow", "engine", "--repo-dir", str(tmp_path / "repo2"), cwd=tmp_path)
    assert engine.returncode == 0 and "flow engine" in engine.stdout and "trtllm-build" in engine.stdout


# ---- the seven defects of issue 15 ----------------------------------------------------------------------------


def test_defect1_engine_flow_quantize_passes_no_export_format(tmp_path):
    """quantize.py @c8c6df08 has no --export_format (and 1.2.1's quantize_and_export takes none)."""
    plan = make_plan(_engine_cfg(tmp_path, quant="int4-wo", draft_quant="int8", tp_size=4))
    for role in ("target", "draft"):
        flags = _flags(_step(plan, f"{role}.quantize").argv)
        assert "--export_format" not in flags and set(flags) <= QUANTIZE_FLAGS_C8C6DF08, set(flags) - QUANTIZE_FLAGS_C8C6DF08


def test_defect2_preprocessing_has_an_empty_multimodal_model_path(tmp_path):
    """preprocessing/1/model.py @01259b15 reads parameters['multimodal_model_path'] unguarded; "" = none."""
    _, configs = _written_repo(tmp_path)
    params = {k: v.string_value for k, v in configs["preprocessing"].parameters.items()}
    assert params["multimodal_model_path"] == "" and params["tokenizer_dir"]


def test_defect3_fp8_kv_cache_only_with_fp8_weights_on_the_engine_flow(tmp_path):
    """tensorrt_llm/builder.py @14e801da: an fp8 KV cache on non-FP8/W4A8_AWQ/NVFP4 weights turns paged context FMHA off."""
    with pytest.raises(UsageError, match="--kv-cache-dtype fp8 with --quant int4-wo .* paged context FMHA off"):
        make_plan(_engine_cfg(tmp_path, quant="int4-wo", kv_cache_dtype="fp8", tp_size=8))
    plan = make_plan(_engine_cfg(tmp_path, quant="fp8", draft_quant="int8", kv_cache_dtype="fp8", tp_size=8))
    assert (plan.target.kv_cache_dtype, plan.draft.kv_cache_dtype) == ("fp8", "auto")
    assert _flags(_step(plan, "target.quantize").argv)["--kv_cache_dtype"] == "fp8"
    assert "--kv_cache_dtype" not in _flags(_step(plan, "draft.quantize").argv)
    assert any("the draft keeps a float16 KV cache" in n for n in plan.notes)
    assert plan.memory.draft.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2  # fp16 KV, 32 layers x 32 KV heads x 128
    # the PyTorch backend has no such rule: both models keep the fp8 KV cache asked for
    llmapi = make_plan(_cfg(tmp_path, kv_cache_dtype="fp8", tp_size=8))
    assert (llmapi.target.kv_cache_dtype, llmapi.draft.kv_cache_dtype) == ("fp8", "fp8")


def test_defect4_engines_run_with_chunked_context(tmp_path):
    """trtGptModel.h @c8c6df08: enable_chunked_context lifts maxInputLen to maxSequenceLen - 1, so the BLS loop's
    growing re-sent prompt is not refused past max_input_len; it needs paged context FMHA (kept, defect 3)."""
    plan, configs = _written_repo(tmp_path)
    for name in ("tensorrt_llm", "tensorrt_llm_draft"):
        assert configs[name].parameters["enable_chunked_context"].string_value == "true"
    for role in ("target", "draft"):
        assert _flags(_step(plan, f"{role}.engine").argv)["--use_paged_context_fmha"] == "enable"


def test_defect5_llmapi_config_pbtxt_is_decoupled_like_model_yaml(tmp_path):
    """launch_triton_server.py @0a2e2c1f passes --disable-auto-complete-config: config.pbtxt must say it itself."""
    cfg = _cfg(tmp_path, tp_size=8)
    write_plan_repository(make_plan(cfg), cfg)
    config = read_config(tmp_path / "repo" / "tensorrt_llm")
    model_yaml = yaml.safe_load((tmp_path / "repo" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert config.model_transaction_policy.decoupled is True
    assert config.model_transaction_policy.decoupled == model_yaml["triton_config"]["decoupled"]
    assert config.max_batch_size == model_yaml["triton_config"]["max_batch_size"]


@pytest.mark.parametrize("option", [dict(quant="int8"), dict(quant="int8-wo"), dict(draft_quant="int8"), dict(kv_cache_dtype="int8")])
def test_defect6_llmapi_flow_refuses_what_the_pytorch_backend_cannot_run(tmp_path, option):
    """docs/source/features/quantization.md (1.3.0rc27): FP8, NVFP4, W4A16/W4A8 AWQ/GPTQ, FP8/NVFP4 KV; no INT8."""
    with pytest.raises(UsageError, match="not supported by TensorRT-LLM's PyTorch backend"):
        make_plan(_cfg(tmp_path, tp_size=8, **option))
    make_plan(_engine_cfg(tmp_path, tp_size=8, **{k: v for k, v in option.items() if k != "kv_cache_dtype"}))  # the engine flow takes them


def test_defect6_refusal_is_one_line_on_the_command_line(tmp_path):
    args = ["build", "--target", "llama-70b", "--draft", "llama-7b", "--backend", "trtllm", "--quant", "int8", "--tp-size", "8",
            "--dry-run", "--repo-dir", str(tmp_path / "r"), "--engines-dir", str(tmp_path / "e")]  # fmt: skip
    result = _specpipe(*args, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "--quant int8 is not supported by TensorRT-LLM's PyTorch backend" in result.stderr and "--trtllm-flow engine" in result.stderr


def test_defect7_tensorrt_int8_plan_asks_for_symmetric_activations(tmp_path, smollm2_draft):
    plan = make_plan(_cfg(tmp_path, backend="tensorrt", target="smollm2-135m", draft=str(smollm2_draft), quant="int8", repo_dir=None))
    assert _step(plan, "target.quantize").kwargs["symmetric_activations"] is True


# ---- in-flight batching: the batch-size-to-draft-length schedule -----------------------------------------------


def test_default_draft_len_schedule_shortens_drafts_as_the_batch_grows():
    from specpipe.builder.trtllm import check_draft_len_schedule, default_draft_len_schedule

    assert default_draft_len_schedule(8, 8) == {1: 8, 4: 4, 8: 2}
    assert default_draft_len_schedule(4, 64) == {1: 4, 4: 2, 8: 1, 16: 0}
    assert default_draft_len_schedule(5, 2) == {1: 5}
    for k, batch in ((1, 1), (8, 256), (64, 1024)):
        assert check_draft_len_schedule(default_draft_len_schedule(k, batch), k) == []


def test_draft_len_schedule_follows_upstreams_rules(tmp_path):
    """DecodingBaseConfig.validate_draft_len_schedule_and_sort: {1: max_draft_len} required, lengths 0..max_draft_len."""
    plan = make_plan(_cfg(tmp_path, tp_size=8, max_batch_size=64, draft_len_schedule={1: 8, 16: 3, 32: 0}))
    assert any("{1: 8, 16: 3, 32: 0}" in n for n in plan.notes)
    with pytest.raises(UsageError, match="must map batch size 1 to max_draft_len 8"):
        make_plan(_cfg(tmp_path, tp_size=8, draft_len_schedule={1: 4}))
    with pytest.raises(UsageError, match="draft length 9 .* must be in 0..8"):
        make_plan(_cfg(tmp_path, tp_size=8, draft_len_schedule={1: 8, 4: 9}))


def test_an_eagle3_head_gets_eagle3_decoding(tmp_path):
    head = tmp_path / "eagle3-head"
    head.mkdir()
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
        "num_key_value_heads": 8, "num_hidden_layers": 1, "vocab_size": 32000, "max_position_embeddings": 4096,
    }  # fmt: skip
    (head / "config.json").write_text(json.dumps(config))
    cfg = _cfg(tmp_path, draft=str(head), tp_size=8, max_batch_size=32)
    plan = make_plan(cfg)
    write_plan_repository(plan, cfg)
    spec = yaml.safe_load((tmp_path / "repo" / "tensorrt_llm" / "1" / "model.yaml").read_text())["speculative_config"]
    # plan {1: 8, 4: 4, 8: 2, 16: 1, 32: 0} read "up to key" at v1.3.0rc26: batch 32 drafts 0 (above the largest key)
    assert spec["decoding_type"] == "Eagle3" and spec["draft_len_schedule"] == {1: 8, 3: 8, 7: 4, 15: 2, 31: 1}
    assert "eagle3_layers_to_capture" not in spec  # the head names none: TensorRT-LLM's default set
    with pytest.raises(UsageError, match="EAGLE-3 head drafts through the LLM-API flow only"):
        make_plan(_engine_cfg(tmp_path, draft=str(head), tp_size=8))


def test_a_stream_interval_is_refused_where_tensorrt_llm_serves(tmp_path):
    """TensorRT-LLM's repository streams as its executor does: --stream-interval would be ignored there, silently."""
    for flow in ("llmapi", "engine"):
        with pytest.raises(UsageError, match="--stream-interval 4 applies to specpipe's Triton model"):
            make_plan(_cfg(tmp_path, trtllm_flow=flow, stream_interval=4))
    assert make_plan(_cfg(tmp_path, stream_interval=1))


def test_llmapi_flow_refuses_a_separate_draft_gpu(tmp_path):
    with pytest.raises(UsageError, match="--draft-placement separate needs --trtllm-flow engine"):
        make_plan(_cfg(tmp_path, tp_size=8, draft_placement="separate"))


# ---- upstream facts, pinned --------------------------------------------------------------------------------------


def test_upstream_facts_match_the_copies_here():
    """specpipe/engines/upstream.py against the values copied in this file from the sources named there."""
    from specpipe.engines import upstream
    from specpipe.triton.trtllm_repo import LLMAPI_INPUTS

    assert upstream.TRTLLM_ENGINE_VERSION == "1.2.1" and upstream.TRTLLM_LLMAPI_MIN_VERSION == "1.3.0rc26"
    assert set(upstream.TRTLLM_REMOVAL_PRS) == {11723, 15763, 15767, 15907, 15918}
    assert upstream.LLMAPI_QUANT_MODES == ("none", "fp8", "int4-wo") and upstream.LLMAPI_KV_CACHE_DTYPES == ("auto", "fp8")
    assert set(upstream.MODELOPT_PTQ_FLAGS) <= HF_PTQ_FLAGS
    assert set(upstream.MODELOPT_QFORMAT_FOR_MODE.values()) <= HF_PTQ_QFORMATS
    assert set(upstream.MODELOPT_KV_QFORMAT.values()) <= HF_PTQ_KV_QFORMATS
    assert upstream.DECODING_TYPES == {"draft_target": "Draft_Target", "eagle3": "Eagle3", "ngram": "NGram"}
    assert set(upstream.DECODING_BASE_FIELDS) <= DECODING_BASE_FIELDS and set(upstream.LLM_ARGS) <= LLM_ARGS
    assert set(upstream.QUANTIZE_FLAGS_ENGINE_FLOW) <= QUANTIZE_FLAGS_C8C6DF08
    assert upstream.FP8_KV_WEIGHT_QUANT == ("fp8",)
    assert upstream.PREPROCESSING_REQUIRED_PARAMETERS == ("tokenizer_dir", "multimodal_model_path")
    assert upstream.LAUNCH_DISABLES_AUTO_COMPLETE == "--disable-auto-complete-config"
    assert upstream.TRTLLM_SERVE_CONFIG_FLAG == "--extra_llm_api_options"
    served = {t.name: t.data_type for t in LLMAPI_INPUTS}
    assert {k: served[k] for k in LLMAPI_CLIENT_TENSORS} == LLMAPI_CLIENT_TENSORS
    assert {k: upstream.LLMAPI_REQUEST_TENSORS[k] for k in LLMAPI_CLIENT_TENSORS} == LLMAPI_CLIENT_TENSORS


# ---- the SmolLM2 pair and the tensorrt backend ----------------------------------------------------------


@pytest.fixture
def smollm2_draft(tmp_path) -> Path:
    """A distilled 2-layer draft with SmolLM2-135M's width and tokenizer (config.json only: plans read no weights)."""
    folder = tmp_path / "smollm2-draft"
    folder.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
        "num_key_value_heads": 3, "num_hidden_layers": 2, "vocab_size": 49152, "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_smollm2_trtllm_plan(tmp_path, smollm2_draft):
    plan = make_plan(_engine_cfg(tmp_path, target="smollm2-135m", draft=str(smollm2_draft), quant="fp8", tp_size=1))
    assert plan.draft.shape.layers == 2 and plan.draft.shape.kv_heads == 3
    assert _flags(_step(plan, "target.engine").argv)["--max_seq_len"] == "8192"
    assert plan.memory.target.weights_total_gb < 0.3
    assert "compared token by token" in " ".join(plan.notes)  # a folder draft: checked when resolved


def test_tensorrt_plan_exports_each_model_once_and_runs_no_cpu_build(tmp_path, smollm2_draft):
    """The TensorRT deployment is built from one export per model; the manifest and specpipe's repository are
    written for its engines (issue 15: the plan ran the whole CPU build, exports included, first)."""
    plan = make_plan(_cfg(tmp_path, backend="tensorrt", target="smollm2-135m", draft=str(smollm2_draft)))
    assert [s.role for s in plan.steps if s.kind == "export"] == ["target", "draft"]
    assert not [s for s in plan.steps if (s.call or "").startswith("specpipe.builder")]
    export = _step(plan, "draft.export")
    assert export.kwargs["checkpoint"] == str(tmp_path / "engines" / plan.name / "hf" / "draft")  # the resolved folder
    manifest, repository = _step(plan, "manifest"), _step(plan, "repository")
    assert manifest.gpu and manifest.writes == (str(tmp_path / "engines" / plan.name / "manifest.json"),)
    assert repository.writes == (str(tmp_path / "repo" / "ensemble"),)
    assert plan.target.artifacts == str(tmp_path / "engines" / plan.name / "target")


def test_smollm2_tensorrt_plan_and_profiles(tmp_path, smollm2_draft):
    plan = make_plan(_cfg(tmp_path, backend="tensorrt", target="smollm2-135m", draft=str(smollm2_draft), repo_dir=None))
    ids = [s.id for s in plan.steps]
    assert ids[:6] == ["target.resolve", "draft.resolve", "tokenizer", "target.export", "target.autocast", "target.engine"]
    assert ids[-2:] == ["manifest", "plan"]
    engine = _step(plan, "target.engine")
    assert engine.call == "tensorrt.Builder.build_serialized_network" and engine.kwargs["network_flags"] == ["STRONGLY_TYPED"]
    assert set(engine.kwargs["profiles"]) == {"prefill", "decode", "verify"}
    assert _step(plan, "target.autocast").kwargs["low_precision_type"] == "fp16"

    shape = shape_from_config(json.loads((smollm2_draft / "config.json").read_text()), spec="d")
    profiles = optimization_profiles(shape, max_seq_len=512, max_input_len=256, max_draft_len=4)
    prefill, decode, verify = profiles
    assert verify.new_tokens.min == 2 and verify.new_tokens.max == 5  # last context token + K drafts
    assert decode.new_tokens.max == 1 and prefill.new_tokens.max == 256
    kv = verify.shapes["past_key_values.1.value"]
    assert kv.min == (1, 3, 0, 64) and kv.max == (1, 3, 510, 64)  # [batch, kv_heads, past, head_dim]
    assert set(verify.shapes) == {"input_ids", "attention_mask", "position_ids"} | {
        f"past_key_values.{i}.{kind}" for i in range(2) for kind in ("key", "value")
    }
    for p in profiles:  # TensorRT requires min <= opt <= max in every dimension, the mask never past max_seq_len
        for rng in p.shapes.values():
            assert all(a <= b <= c for a, b, c in zip(rng.min, rng.opt, rng.max))
        assert p.shapes["attention_mask"].max[1] <= 512
    # every call the decoder can make has a profile; the narrowest one wins
    assert [select_profile(profiles, n, 10) for n in (1, 2, 5, 6, 256)] == [1, 2, 2, 0, 0]
    assert select_profile(profiles, 1, 0) == 1


def test_tensorrt_backend_refusals(tmp_path):
    with pytest.raises(UsageError, match="--tp-size does not apply to --backend tensorrt"):
        make_plan(_cfg(tmp_path, backend="tensorrt", target="smollm2-135m", draft="smollm2-135m", tp_size=2))
    with pytest.raises(UsageError, match="MatMulNBits"):
        make_plan(_cfg(tmp_path, backend="tensorrt", target="smollm2-135m", draft="smollm2-135m", quant="int4-wo"))
    with pytest.raises(UsageError, match="--kv-cache-dtype needs --backend trtllm"):
        make_plan(_cfg(tmp_path, backend="tensorrt", target="smollm2-135m", draft="smollm2-135m", kv_cache_dtype="fp8"))


# ---- the command line ---------------------------------------------------------------------------------------


def _specpipe(*args, cwd: Path) -> subprocess.CompletedProcess:
    repo_root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo_root), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "specpipe", *args], capture_output=True, text=True, cwd=cwd, env=env)


def test_cli_dry_run_prints_plan_and_writes_repo(tmp_path):
    args = ["build", "--target", "llama-70b", "--draft", "llama-7b", "--backend", "trtllm", "--trtllm-flow", "engine", "--quant", "fp8",
            "--tp-size", "8", "--dry-run", "--repo-dir", str(tmp_path / "repo"), "--engines-dir", str(tmp_path / "engines")]  # fmt: skip
    text = _specpipe(*args, cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert "trtllm-build" in text.stdout and "draft_tokens_external" in text.stdout and "GPU memory" in text.stdout
    assert {p.name for p in (tmp_path / "repo").iterdir()} == SIX_MODELS
    as_json = _specpipe(*args, "--json", cwd=tmp_path)
    plan = json.loads(as_json.stdout)
    assert plan["backend"] == "trtllm" and plan["target"]["tp"] == 8 and len(plan["memory"]["gpus"]) == 8


def test_cli_real_build_without_gpu_stops_in_one_line(tmp_path):
    args = ["build", "--target", "llama-70b", "--draft", "llama-7b", "--backend", "trtllm", "--tp-size", "8",
            "--repo-dir", str(tmp_path / "repo"), "--engines-dir", str(tmp_path / "engines")]  # fmt: skip
    for flow, wanted in (("engine", "tensorrt-llm==1.2.1"), ("llmapi", "tensorrt-llm>=1.3.0")):
        result = _specpipe(*args, "--trtllm-flow", flow, "--quant", "fp8", cwd=tmp_path)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert "a CUDA GPU" in result.stderr and wanted in result.stderr, result.stderr
        assert not (tmp_path / "engines").exists() and not (tmp_path / "repo").exists()


def test_cli_gpu_memory_error_is_one_line(tmp_path):
    args = ["build", "--target", "llama-70b", "--draft", "llama-7b", "--backend", "trtllm", "--quant", "fp8", "--draft-quant", "fp8",
            "--kv-cache-dtype", "fp8", "--tp-size", "1", "--gpu-memory-gb", "80", "--dry-run", "--repo-dir", str(tmp_path / "r")]  # fmt: skip
    result = _specpipe(*args, cwd=tmp_path)
    assert result.returncode == 2 and "use --tp-size 2" in result.stderr and result.stderr.count("\n") == 1


def test_render_plan_lists_every_file(tmp_path):
    plan = make_plan(_engine_cfg(tmp_path, quant="fp8", tp_size=4))
    text = render_plan(plan)
    for path in plan.files:
        assert path in text
    assert "rank3.engine" in text and "busiest" not in text  # no --gpu-memory-gb: no verdict


def test_defect7_symmetric_activations_put_every_int8_activation_zero_point_at_0(tiny_target, tmp_path):
    """TensorRT's quantize layer takes zero point 0 only; ONNX Runtime's default calibration is asymmetric."""
    import onnx
    from transformers import AutoTokenizer

    from specpipe.contract.quant import QuantConfig
    from specpipe.export.onnx import export_onnx
    from specpipe.quantize.calibration import calibration_batches
    from specpipe.quantize.graph import load_model, untie_lm_head
    from specpipe.quantize.static import quantize_calibrated

    raw = export_onnx(tiny_target, tmp_path / "onnx")
    quant = QuantConfig(mode="int8")
    calib = calibration_batches(AutoTokenizer.from_pretrained(str(tiny_target)), quant)

    def activation_zero_points(symmetric: bool) -> list[int]:
        model = load_model(raw)
        untie_lm_head(model)
        out = tmp_path / f"int8-{symmetric}"
        out.mkdir()
        quantize_calibrated(model, out, mode="int8", calib=calib, window=quant.calib_window, smooth_quant=False,
                            symmetric_activations=symmetric)  # fmt: skip
        graph = load_model(out).graph
        per_tensor = [i for i in graph.initializer if i.name.endswith("_zero_point") and len(i.dims) == 0]
        return [int(onnx.numpy_helper.to_array(i)) for i in per_tensor]

    symmetric = activation_zero_points(True)
    assert symmetric and set(symmetric) == {0}
    assert set(activation_zero_points(False)) != {0}  # the check can fail: the CPU build's calibration is asymmetric


def test_ngram_drafting_plans_ngram_decoding_without_a_draft_model(tmp_path):
    cfg = _cfg(tmp_path, draft="ngram", quant="fp8", tp_size=8)
    plan = make_plan(cfg)
    assert plan.draft is None and plan.memory.draft is None and len(plan.memory.gpus) == 8
    assert {s.id for s in plan.steps} >= {"target.resolve", "target.quantize"} and "draft.resolve" not in {s.id for s in plan.steps}
    write_plan_repository(plan, cfg)
    spec = yaml.safe_load((tmp_path / "repo" / "tensorrt_llm" / "1" / "model.yaml").read_text())["speculative_config"]
    assert spec == {"decoding_type": "NGram", "max_draft_len": 8, "max_matching_ngram_size": 3}  # no 0 tier below batch 8
    assert "n-gram lookup" in render_plan(plan) and not any("inside the target's LLM" in n for n in plan.notes)
    assert yaml.safe_load((tmp_path / "engines" / plan.name / "trtllm-serve.yaml").read_text())["kv_cache_config"][
        "free_gpu_memory_fraction"
    ] == 0.9  # no draft model shares the GPUs
    with pytest.raises(UsageError, match="--draft ngram on a GPU needs --backend trtllm and the LLM-API flow"):
        make_plan(_engine_cfg(tmp_path, draft="ngram", tp_size=8))
