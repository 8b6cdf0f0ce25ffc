"""Triton Inference Server: a typed repository model rendered through Triton's protobuf, the served
Python-backend model (tensorrtllm_backend's tensor names, speculative decoding, streaming), the server
process, and a gRPC client.

    write_repository(engine_dir, repo_dir)            -> <repo>/ensemble/ (config.pbtxt, 1/model.py, 1/engine/)
    with TritonServer(repo_dir, ServerConfig()) as s:  -> s.url ("127.0.0.1:8001"), s.metrics_url
        remote_generate(s.url, prompt, cfg, stream=True)
"""

from specpipe.triton.model_config import DynamicBatching, EnsembleStep, ModelSpec, TensorSpec, parse_config, read_config
from specpipe.triton.repository import ModelParameters, served_model_spec, write_repository
from specpipe.triton.server import ServerConfig, TritonServer, find_tritonserver, free_port, free_ports

__all__ = [
    "DynamicBatching", "EnsembleStep", "ModelParameters", "ModelSpec", "ServerConfig", "TensorSpec", "TritonServer",
    "find_tritonserver", "free_port", "free_ports", "parse_config", "read_config", "served_model_spec", "write_repository",
]
