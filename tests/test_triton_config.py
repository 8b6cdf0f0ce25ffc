"""The Triton repository without a server: config.pbtxt through protobuf, upstream tensor compatibility,
request validation, repository layout and atomicity, and reading the server's failure from its log."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from specpipe.contract.manifest import Manifest, write_manifest
from specpipe.drafts.none import NoDraft
from specpipe.errors import EngineError, OutputExistsError, UsageError
from specpipe.triton import ModelSpec, TensorSpec, parse_config, read_config, served_model_spec, write_repository
from specpipe.triton.model_config import DynamicBatching, EnsembleStep
from specpipe.triton.protocol import EXTENSION_INPUTS, EXTENSION_OUTPUTS, parse_request
from specpipe.triton.repository import ModelParameters
from specpipe.triton.server import failure_reason

# Inputs and outputs of tensorrtllm_backend all_models/inflight_batcher_llm/tensorrt_llm_bls/config.pbtxt at
# commit c2e65b88d85255be30cf50440a91662abeb497dd, parsed with model_config_pb2 and printed one per line
# (the ${...} template values filled in; context/generation_logits take ${logits_datatype}, FP32 here).
UPSTREAM_BLS_IO = """
input {name: "text_input" data_type: TYPE_STRING dims: 1}
input {name: "decoder_text_input" data_type: TYPE_STRING dims: 1 optional: true}
input {name: "image_input" data_type: TYPE_FP16 dims: -1 dims: 3 dims: -1 dims: -1 optional: true}
input {name: "image_bytes_input" data_type: TYPE_UINT8 dims: -1 dims: -1 dims: -1 dims: -1 optional: true}
input {name: "image_url_input" data_type: TYPE_STRING dims: 1 optional: true}
input {name: "video_bytes_input" data_type: TYPE_UINT8 dims: -1 dims: -1 dims: -1 dims: -1 optional: true}
input {name: "max_tokens" data_type: TYPE_INT32 dims: 1}
input {name: "bad_words" data_type: TYPE_STRING dims: -1 optional: true}
input {name: "stop_words" data_type: TYPE_STRING dims: -1 optional: true}
input {name: "exclude_input_in_output" data_type: TYPE_BOOL dims: 1 optional: true}
input {name: "end_id" data_type: TYPE_INT32 dims: 1 optional: true}
input {name: "pad_id" data_type: TYPE_INT32 dims: 1 optional: true}
input {name: "top_k" data_type: TYPE_INT32 dims: 1 optional: true}
input {name: "top_p" data_type: TYPE_FP32 dims: 1 optional: true}
input {name: "temperature" data_type: TYPE_FP32 dims: 1 optional: true}
input {name: "length_penalty" data_type: TYPE_FP32 dims: 1 optional: true}
input {name: "repetition_penalty" data_type: TYPE_FP32 dims: 1 optional: true}
input {name: "min_tokens" data_type: TYPE_INT32 dims: 1 optional: true}
input {name: "presence_penalty" data_type: TYPE_FP32 dims: 1 optional: true}
input {name: "frequency_penalty" data_type: TYPE_FP32 dims: 1 optional: true}
input {name: "seed" data_type: TYPE_UINT64 dims: 1 optional: true}
input {name: "return_log_probs" data_type: TYPE_BOOL dims: 1 reshape { } optional: true}
input {name: "return_context_logits" data_type: TYPE_BOOL dims: 1 reshape { } optional: true}
input {name: "return_generation_logits" data_type: TYPE_BOOL dims: 1 reshape { } optional: true}
input {name: "num_return_sequences" data_type: TYPE_INT32 dims: 1 reshape { } optional: true}
input {name: "beam_width" data_type: TYPE_INT32 dims: 1 optional: true}
input {name: "stream" data_type: TYPE_BOOL dims: 1 optional: true}
input {name: "prompt_embedding_table" data_type: TYPE_FP16 dims: -1 dims: -1 optional: true}
input {name: "prompt_vocab_size" data_type: TYPE_INT32 dims: 1 optional: true}
input {name: "prompt_table_extra_id" data_type: TYPE_UINT64 dims: 1 optional: true}
input {name: "embedding_bias_words" data_type: TYPE_STRING dims: -1 optional: true}
input {name: "embedding_bias_weights" data_type: TYPE_FP32 dims: -1 optional: true}
input {name: "num_draft_tokens" data_type: TYPE_INT32 dims: 1 optional: true}
input {name: "use_draft_logits" data_type: TYPE_BOOL dims: 1 reshape { } optional: true}
input {name: "lora_task_id" data_type: TYPE_UINT64 dims: 1 reshape { } optional: true}
input {name: "lora_weights" data_type: TYPE_FP16 dims: -1 dims: -1 allow_ragged_batch: true optional: true}
input {name: "lora_config" data_type: TYPE_INT32 dims: -1 dims: 3 allow_ragged_batch: true optional: true}
input {name: "return_perf_metrics" data_type: TYPE_BOOL dims: 1 reshape { } optional: true}
input {name: "guided_decoding_guide_type" data_type: TYPE_STRING dims: 1 optional: true}
input {name: "guided_decoding_guide" data_type: TYPE_STRING dims: 1 optional: true}
output {name: "text_output" data_type: TYPE_STRING dims: -1}
output {name: "cum_log_probs" data_type: TYPE_FP32 dims: -1}
output {name: "output_log_probs" data_type: TYPE_FP32 dims: -1 dims: -1}
output {name: "context_logits" data_type: TYPE_FP32 dims: -1 dims: -1}
output {name: "generation_logits" data_type: TYPE_FP32 dims: -1 dims: -1 dims: -1}
output {name: "batch_index" data_type: TYPE_INT32 dims: 1}
output {name: "sequence_index" data_type: TYPE_INT32 dims: 1}
output {name: "kv_cache_alloc_new_blocks" data_type: TYPE_INT32 dims: 1}
output {name: "kv_cache_reused_blocks" data_type: TYPE_INT32 dims: 1}
output {name: "kv_cache_alloc_total_blocks" data_type: TYPE_INT32 dims: 1}
output {name: "arrival_time_ns" data_type: TYPE_INT64 dims: 1}
output {name: "first_scheduled_time_ns" data_type: TYPE_INT64 dims: 1}
output {name: "first_token_time_ns" data_type: TYPE_INT64 dims: 1}
output {name: "last_token_time_ns" data_type: TYPE_INT64 dims: 1}
output {name: "acceptance_rate" data_type: TYPE_FP32 dims: 1}
output {name: "total_accepted_draft_tokens" data_type: TYPE_INT32 dims: 1}
output {name: "total_draft_tokens" data_type: TYPE_INT32 dims: 1}
"""
MULTIMODAL = {"image_input", "image_bytes_input", "image_url_input", "video_bytes_input"}


def test_served_config_round_trips_through_text_format(tmp_path):
    spec = served_model_spec("ensemble", instance_count=3, parameters=ModelParameters(engine_threads=1))
    path = spec.write(tmp_path / "ensemble")
    parsed = read_config(tmp_path / "ensemble")
    assert parsed == spec.to_proto()
    assert text_format.MessageToString(parsed) == path.read_text()
    assert parsed.backend == "python" and parsed.model_transaction_policy.decoupled
    assert parsed.max_batch_size == 1  # clients send [1, 1] per scalar, as to TensorRT-LLM
    assert [(g.count, mc.ModelInstanceGroup.Kind.Name(g.kind)) for g in parsed.instance_group] == [(3, "KIND_CPU")]
    assert {k: v.string_value for k, v in parsed.parameters.items()} == {
        "engine_dir": "engine", "engine_threads": "1", "exclude_input_in_output": "true", "max_batch_size": "0",
        "max_queue": "-1", "stream_interval": "1", "protocol": "tensorrtllm_backend"
    }
    assert ModelParameters.from_triton(json.loads(_as_json(parsed))) == ModelParameters(engine_threads=1)


def _as_json(proto) -> str:
    from google.protobuf.json_format import MessageToJson

    return MessageToJson(proto, preserving_proto_field_name=True)


def test_served_tensors_match_tensorrtllm_bls_exactly():
    upstream = text_format.Parse(UPSTREAM_BLS_IO, mc.ModelConfig())
    served = served_model_spec().to_proto()
    served_inputs = {t.name: t for t in served.input}
    served_outputs = {t.name: t for t in served.output}
    for tensor in upstream.input:
        if tensor.name not in MULTIMODAL:
            assert served_inputs.pop(tensor.name) == tensor, tensor.name
    for tensor in upstream.output:
        assert served_outputs.pop(tensor.name) == tensor, tensor.name
    # What is left are specpipe's additions: all optional, so a TRT-LLM client never has to send them.
    assert set(served_inputs) == {"random_seed"} | {t.name for t in EXTENSION_INPUTS}
    assert all(t.optional for t in served_inputs.values())
    assert set(served_outputs) == {t.name for t in EXTENSION_OUTPUTS}


def test_model_spec_renders_tensorrtllm_style_models():
    """What issue 7's writer needs: parameters, GPU instances, dynamic batching, an ensemble's wiring."""
    trtllm = ModelSpec(
        name="tensorrt_llm", backend="tensorrtllm", max_batch_size=64, decoupled=True,
        inputs=(TensorSpec(name="input_ids", data_type="INT32", dims=(-1,), allow_ragged_batch=True),),
        outputs=(TensorSpec(name="output_ids", data_type="INT32", dims=(-1, -1)),),
        instance_kind="KIND_GPU", instance_gpus=(0, 1),
        parameters={"gpt_model_path": "/engines/target", "batching_strategy": "inflight_fused_batching"},
        dynamic_batching=DynamicBatching(preferred_batch_size=(64,), max_queue_delay_microseconds=100, max_queue_size=0),
    )
    parsed = parse_config(trtllm.render())
    assert parsed == trtllm.to_proto()
    assert list(parsed.instance_group[0].gpus) == [0, 1]
    assert parsed.parameters["gpt_model_path"].string_value == "/engines/target"
    assert list(parsed.dynamic_batching.preferred_batch_size) == [64]
    assert parsed.dynamic_batching.HasField("default_queue_policy")

    ensemble = ModelSpec(
        name="ensemble", platform="ensemble", max_batch_size=64, instance_count=None,
        inputs=(TensorSpec(name="text_input", data_type="STRING", dims=(1,)),),
        outputs=(TensorSpec(name="text_output", data_type="STRING", dims=(-1,)),),
        ensemble_steps=(
            EnsembleStep(model_name="preprocessing", input_map={"QUERY": "text_input"}, output_map={"INPUT_ID": "_INPUT_ID"}),
            EnsembleStep(model_name="tensorrt_llm", input_map={"input_ids": "_INPUT_ID"}, output_map={"output_ids": "_TOKENS"}),
        ),
    )
    parsed = parse_config(ensemble.render())
    assert parsed == ensemble.to_proto()
    assert not parsed.instance_group
    assert [s.model_name for s in parsed.ensemble_scheduling.step] == ["preprocessing", "tensorrt_llm"]
    assert parsed.ensemble_scheduling.step[0].input_map["QUERY"] == "text_input"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"backend": "python", "platform": "ensemble"}, "exactly one of backend or platform"),
        ({"backend": "python", "inputs": (TensorSpec(name="a", data_type="INT32", dims=(1,)),) * 2}, "duplicate input"),
        ({"platform": "ensemble"}, "ensemble_steps"),
    ],
)
def test_model_spec_refuses_inconsistent_models(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec(name="m", **kwargs)


def test_tensor_spec_refuses_unknown_types():
    with pytest.raises(ValueError, match="unknown Triton data type"):
        TensorSpec(name="x", data_type="FLOAT", dims=(1,))


def test_parse_config_refuses_unknown_fields():
    with pytest.raises(text_format.ParseError):
        parse_config('name: "m"\nbackend: "python"\ndecoupled: true\n')


# -- requests ---------------------------------------------------------------------------------------

def _request(**values) -> dict[str, np.ndarray]:
    """A request as the Python backend hands it over: arrays with the batch dimension."""
    dtypes = {str: np.object_, bool: bool, int: np.int32, float: np.float32}
    tensors = {"text_input": np.array([[b"def add(a, b):"]], dtype=np.object_), "max_tokens": np.array([[16]], np.int32)}
    for name, value in values.items():
        if value is None:
            tensors.pop(name, None)
        elif isinstance(value, np.ndarray):
            tensors[name] = value
        else:
            value = value.encode() if isinstance(value, str) else value
            tensors[name] = np.array([[value]], dtype=dtypes[type(value) if not isinstance(value, bytes) else str])
    return tensors


def test_parse_request_maps_tensorrt_llm_inputs_to_a_generation_config():
    request = parse_request(_request(
        temperature=0.5, top_k=7, top_p=0.0, seed=np.array([[42]], np.uint64), num_draft_tokens=3, stream=True,
        stop_words=np.array([[b"\n\n", b"", b"END"]], dtype=np.object_), return_perf_metrics=True, end_id=2,
        beam_width=1, repetition_penalty=1.0, pad_id=0, exclude_input_in_output=False, use_draft_logits=True,
    ))
    assert request.prompt == "def add(a, b):"
    assert request.config == {
        "max_new_tokens": 16, "seed": 42, "stop": ["\n\n", "END"],
        "sampling": {"temperature": 0.5, "top_k": 7, "top_p": 1.0},  # top_p 0 = off, as in TensorRT-LLM
        "speculative": True, "num_draft_tokens": 3, "draft_length": "fixed",
    }
    assert (request.stream, request.return_perf_metrics, request.end_id, request.exclude_input_in_output) == (
        True, True, 2, False)
    assert parse_request(_request(num_draft_tokens=0)).config["speculative"] is False
    assert parse_request(_request(random_seed=np.array([[7]], np.uint64))).config["seed"] == 7


def test_parse_request_takes_a_generation_config_as_the_base():
    base = {"max_new_tokens": 99, "num_draft_tokens": 2, "draft_length": "adaptive", "sampling": {"temperature": 0.7}}
    request = parse_request(_request(generation_config=json.dumps(base), max_tokens=np.array([[5]], np.int32)))
    assert request.config == {**base, "max_new_tokens": 5}  # the TensorRT-LLM tensor wins


@pytest.mark.parametrize(
    "values, message",
    [
        ({"text_input": None}, "missing required input 'text_input'"),
        ({"text_input": ""}, "text_input is empty"),
        ({"text_input": np.array([[b"\xff\xfe"]], dtype=np.object_)}, "not valid UTF-8"),
        ({"max_tokens": None}, "missing required input 'max_tokens'"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": -5}, "max_tokens must be >= 1, got -5"),
        ({"max_tokens": 2.0}, "'max_tokens' must be TYPE_INT32"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"num_draft_tokens": -1}, "num_draft_tokens must be >= 0"),
        ({"stop_words": np.array([[1, 2]], np.int32)}, "'stop_words' must be TYPE_STRING"),
        ({"beam_width": 4}, "beam_width must be 1"),
        ({"repetition_penalty": 1.2}, "repetition_penalty is not supported"),
        ({"return_log_probs": True}, "return_log_probs is not supported"),
        ({"lora_task_id": np.array([[3]], np.uint64)}, "LoRA is not supported"),
        ({"max_tokens": np.array([[1, 2]], np.int32)}, "max_tokens takes one value per request, got 2"),
        ({"generation_config": "{not json"}, "generation_config is not valid JSON"),
        ({"frobnicate": True}, "unknown input 'frobnicate'"),
    ],
)
def test_parse_request_refuses_bad_requests_with_the_reason(values, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_request(_request(**values))


# -- repository on disk ------------------------------------------------------------------------------

@pytest.fixture
def fake_build(tmp_path):
    """Just enough of engines/<name>/ for the writer (it does not open engines)."""
    build = tmp_path / "engines" / "tiny"
    (build / "target").mkdir(parents=True)
    (build / "tokenizer").mkdir()
    (build / "onnx").mkdir()  # a GPU build's work files: not part of the deployment
    manifest = Manifest(name="tiny", created="", tokenizer={"hash": "h"}, target={"source": "t", "engine": {"path": "target"}},
                        draft=NoDraft())
    write_manifest(build, manifest)
    (build / "target" / "model.onnx").write_bytes(b"\0" * 1024)
    return build


def test_write_repository_layout_links_and_force(fake_build, tmp_path):
    repo = tmp_path / "triton_repo"
    repo.mkdir()
    (repo / "README.md").write_text("kept")
    model_dir = write_repository(fake_build, repo, instance_count=2, model_name="ensemble")
    assert model_dir == repo / "ensemble"
    assert (model_dir / "1" / "model.py").read_text().startswith('"""Triton Python-backend model')
    engine = model_dir / "1" / "engine"
    assert json.loads((engine / "manifest.json").read_text())["name"] == "tiny"
    # same filesystem: hard links, no second copy of the weights
    assert os.stat(engine / "target" / "model.onnx").st_ino == os.stat(fake_build / "target" / "model.onnx").st_ino
    assert read_config(model_dir).instance_group[0].count == 2
    assert sorted(p.name for p in engine.iterdir()) == ["manifest.json", "target", "tokenizer"]  # what the manifest names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engines", "triton_repo"]  # no staging left behind

    with pytest.raises(OutputExistsError, match="pass --force"):
        write_repository(fake_build, repo, instance_count=1)
    assert read_config(model_dir).instance_group[0].count == 2  # untouched

    write_repository(fake_build, repo, instance_count=1, force=True)
    assert read_config(model_dir).instance_group[0].count == 1
    assert (repo / "README.md").read_text() == "kept"
    assert sorted(p.name for p in repo.iterdir()) == ["README.md", "ensemble"]


def test_write_repository_refuses_a_folder_that_is_not_a_build(tmp_path):
    (tmp_path / "nothing").mkdir()
    with pytest.raises(EngineError, match="not a specpipe build"):
        write_repository(tmp_path / "nothing", tmp_path / "repo")
    assert not (tmp_path / "repo").exists()


def test_failure_reason_names_the_model_and_the_first_line_of_why():
    log = [
        'E1122 04:21:08.789733 8729 server.cc:241] "CudaDriverHelper has not been initialized."',
        "E1122 04:21:08.885947 8729 model_lifecycle.cc:642] \"failed to load 'ensemble' version 1: Internal: "
        "TritonModelException: cannot load /r/ensemble/1/engine: EngineError: bad onnx\\n\\nAt:\\n  model.py(40)\"",
        "error: creating server: Internal - failed to load all models",
    ]
    assert failure_reason(log) == (
        "model 'ensemble' failed to load: Internal: TritonModelException: cannot load /r/ensemble/1/engine: "
        "EngineError: bad onnx"
    )
    assert failure_reason(log[:1] + log[2:]) == "error: creating server: Internal - failed to load all models"
    port_taken = "E1122 04:30:00.1 1 main.cc:255] failed to start GRPC service: Unavailable - Socket '127.0.0.1:8001' already in use"
    assert failure_reason(log[:1] + [port_taken]) == port_taken.split("] ", 1)[1]


# -- the llmapi model's names (TensorRT-LLM's current Triton backend) ------------------------------------------

# NVIDIA/TensorRT-LLM triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt @0a710573: name -> (type, dims)
LLMAPI_IO_0A710573 = {
    "text_input": ("STRING", (-1,)), "image_url": ("STRING", (-1,)), "streaming": ("BOOL", (1,)),
    "sampling_param_best_of": ("INT32", (1,)), "sampling_param_temperature": ("FP32", (1,)),
    "sampling_param_top_k": ("INT32", (1,)), "sampling_param_top_p": ("FP32", (1,)),
    "sampling_param_frequency_penalty": ("FP32", (1,)), "sampling_param_presence_penalty": ("FP32", (1,)),
    "sampling_param_max_tokens": ("INT32", (1,)), "sampling_param_stop": ("STRING", (-1,)),
    "sampling_param_seed": ("UINT64", (1,)), "sampling_param_exclude_input_from_output": ("BOOL", (1,)),
    "sampling_param_return_perf_metrics": ("BOOL", (1,)), "return_finish_reason": ("BOOL", (1,)),
    "return_stop_reason": ("BOOL", (1,)), "return_cumulative_logprob": ("BOOL", (1,)), "stop": ("BOOL", (1,)),
    "lora_id": ("UINT64", (1,)), "lora_name": ("STRING", (1,)), "lora_path": ("STRING", (1,)),
    "lora_ckpt_source": ("STRING", (1,)),
    # outputs
    "text_output": ("STRING", (-1,)), "finish_reason": ("STRING", (-1,)), "stop_reason": ("STRING", (-1,)),
    "cumulative_logprob": ("FP32", (-1,)), "kv_cache_reused_block": ("INT32", (-1,)),
    "kv_cache_missed_block": ("INT32", (-1,)), "kv_cache_alloc_new_blocks": ("INT32", (-1,)),
    "kv_cache_alloc_total_blocks": ("INT32", (-1,)), "kv_cache_hit_rate": ("FP32", (-1,)),
    "arrival_time_ns": ("INT64", (1,)), "first_scheduled_time_ns": ("INT64", (1,)), "first_token_time_ns": ("INT64", (1,)),
    "last_token_time_ns": ("INT64", (1,)), "acceptance_rate": ("FP32", (1,)), "total_accepted_draft_tokens": ("INT32", (1,)),
    "total_draft_tokens": ("INT32", (1,)),
}  # fmt: skip


def test_llmapi_shaped_model_serves_upstreams_llmapi_tensors():
    spec = served_model_spec("tensorrt_llm", parameters=ModelParameters(protocol="llmapi")).to_proto()
    assert spec.max_batch_size == 0 and spec.model_transaction_policy.decoupled  # rank-1 tensors, as upstream's
    served = {t.name: (mc.DataType.Name(t.data_type)[5:], tuple(t.dims)) for t in (*spec.input, *spec.output)}
    extensions = {t.name for t in (*EXTENSION_INPUTS, *EXTENSION_OUTPUTS)}
    assert {k: v for k, v in served.items() if k not in extensions} == LLMAPI_IO_0A710573
    assert all(t.optional for t in spec.input if t.name != "text_input")


def _llmapi_request(**values) -> dict[str, np.ndarray]:
    """As the llmapi model receives it: rank-1 tensors (max_batch_size 0)."""
    tensors = {"text_input": np.array([b"def add(a, b):"], dtype=np.object_)}
    return tensors | {k: v if isinstance(v, np.ndarray) else np.array([v]) for k, v in values.items()}


def test_parse_request_takes_the_llmapi_names_with_the_same_meaning():
    llmapi = parse_request(_llmapi_request(
        streaming=True, sampling_param_temperature=np.float32(0.5), sampling_param_top_k=np.int32(7),
        sampling_param_top_p=np.float32(0.9), sampling_param_max_tokens=np.int32(12), sampling_param_seed=np.uint64(42),
        sampling_param_stop=np.array([b"\n\n", b"END"], dtype=np.object_), sampling_param_exclude_input_from_output=False,
        sampling_param_return_perf_metrics=True, return_finish_reason=True, sampling_param_best_of=np.int32(1),
    ))  # fmt: skip
    bls = parse_request(_request(
        stream=True, temperature=0.5, top_k=7, top_p=np.array([[0.9]], np.float32), max_tokens=12,
        seed=np.array([[42]], np.uint64), stop_words=np.array([[b"\n\n", b"END"]], dtype=np.object_),
        exclude_input_in_output=False, return_perf_metrics=True,
    ))  # fmt: skip
    assert llmapi.config == bls.config and llmapi.stream and llmapi.exclude_input_in_output is False
    assert llmapi.llmapi and llmapi.return_finish_reason and not bls.llmapi
    # max tokens are optional there: the deployment's default applies
    assert "max_new_tokens" not in parse_request(_llmapi_request(streaming=False)).config


@pytest.mark.parametrize(
    "values, message",
    [
        ({"sampling_param_best_of": np.int32(2)}, "best_of must be 1"),
        ({"return_stop_reason": True}, "return_stop_reason is not supported"),
        ({"stop": True}, "stop requests are not supported"),
        ({"lora_name": np.array([b"adapter"], dtype=np.object_)}, "LoRA is not supported"),
        ({"sampling_param_max_tokens": np.int32(0)}, "max_tokens must be >= 1, got 0"),
        ({"sampling_param_temperature": np.float32(0.5), "temperature": np.float32(0.5)}, "send one of 'temperature'"),
    ],
)
def test_llmapi_requests_are_refused_with_the_reason(values, message):
    with pytest.raises(UsageError, match=message):
        parse_request(_llmapi_request(**values))


def test_an_llmapi_client_gets_cumulative_streamed_text_without_a_batch_dimension(tiny_build):
    """llmapi's model.py streams RequestOutput.outputs[0].text (the text so far) from a max_batch_size-0 model."""
    from specpipe.deployment import load_deployment
    from specpipe.triton.serving import ServedModel

    deployment = load_deployment(tiny_build, threads=1)
    llmapi = ServedModel(deployment, batched=False)
    request = _llmapi_request(streaming=True, sampling_param_max_tokens=np.int32(12), return_finish_reason=True)
    replies = list(llmapi.replies(request))
    texts = [r.tensors["text_output"][0].decode() for r in replies]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # each response holds the text so far
    final = replies[-1].tensors
    assert final["finish_reason"].shape == (1,) and final["finish_reason"][0] in (b"stop", b"length")
    assert final["token_ids"].ndim == 1 and final["stats_json"].shape == (1,)
    whole = list(ServedModel(deployment).replies(_request(max_tokens=12)))[-1].tensors["text_output"][0].decode()
    assert texts[-1] == whole  # the same generation as a tensorrt_llm_bls client's


@pytest.mark.parametrize("protocol", ["tensorrtllm_backend", "llmapi"])
@pytest.mark.parametrize("interval", [2, 3, 5])
def test_a_stream_interval_sends_the_first_token_at_once_then_gathers_and_loses_nothing(tiny_build, interval, protocol):
    """Each response after the first holds at least `interval` tokens and was sent as soon as it had them, the final
    one what is left (fewer); together the tokens and text of one response a step, in either protocol."""
    from specpipe.deployment import load_deployment
    from specpipe.triton.serving import ServedModel

    deployment = load_deployment(tiny_build, threads=1)
    llmapi = protocol == "llmapi"
    request = (lambda: _llmapi_request(streaming=True, sampling_param_max_tokens=np.int32(20))) if llmapi else (
        lambda: _request(max_tokens=20, stream=True))
    ids = lambda reply: reply.tensors["token_ids"].reshape(-1).tolist()  # noqa: E731
    text = lambda reply: reply.tensors["text_output"].reshape(-1)[0].decode()  # noqa: E731
    each = list(ServedModel(deployment, batched=not llmapi).replies(request()))
    gathered = list(ServedModel(deployment, batched=not llmapi, stream_interval=interval).replies(request()))
    steps = [ids(r) for r in each[:-1]]
    assert sum(map(len, steps)) == 20 and not ids(each[-1])
    assert ids(gathered[0]) == steps[0]  # the first step goes out at once
    sizes = [len(ids(r)) for r in gathered]
    assert all(size >= interval for size in sizes[1:-1]) and sizes[-1] < interval and len(gathered) < len(each)
    # each response went out at the first step that brought its tokens to `interval`
    step_ends = np.cumsum([len(s) for s in steps]).tolist()
    sent_ends = np.cumsum(sizes[:-1]).tolist()
    assert set(sent_ends) <= set(step_ends)
    for before, end in zip(sent_ends, sent_ends[1:]):
        assert end - before >= interval and all(e - before < interval for e in step_ends if before < e < end)
    assert sum((ids(r) for r in gathered), []) == sum((ids(r) for r in each), [])
    if llmapi:  # the text so far in every response
        assert text(gathered[-1]) == text(each[-1]) and all(text(b).startswith(text(a)) for a, b in zip(gathered, gathered[1:]))
    else:
        assert "".join(map(text, gathered)) == "".join(map(text, each))


def test_a_stream_interval_below_one_is_refused(tiny_build):
    from pydantic import ValidationError

    from specpipe.deployment import load_deployment
    from specpipe.triton.serving import ServedModel

    with pytest.raises(ValidationError, match="stream_interval"):
        ModelParameters(stream_interval=0)
    with pytest.raises(UsageError, match="stream_interval must be >= 1, got 0"):
        ServedModel(load_deployment(tiny_build, threads=1), stream_interval=0)
