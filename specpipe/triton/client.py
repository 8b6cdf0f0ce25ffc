"""Generate through a running server over gRPC: `remote_generate()`, used by `specpipe generate --url`.

The request uses TensorRT-LLM's tensor names plus specpipe's `generation_config` (the whole
GenerationConfig as JSON, so a served request decodes exactly as an in-process one) and
`apply_chat_template`. The decoupled model always answers over a gRPC stream, streamed or not.
"""

from __future__ import annotations

import json
import queue
import time
from typing import Iterator, Optional

import numpy as np

from specpipe.contract.generation import GenerationConfig
from specpipe.errors import ServerError, require_text

DEFAULT_MODEL = "ensemble"
# TensorRT-LLM's perf-metric outputs, kept from the final response in result["perf"].
PERF_OUTPUTS = ("arrival_time_ns", "first_token_time_ns", "last_token_time_ns", "acceptance_rate",
                "total_accepted_draft_tokens", "total_draft_tokens")


def remote_generate(url: str, prompt: str, cfg: GenerationConfig, *, stream: bool, chat: bool = False,
                    model_name: str = DEFAULT_MODEL, timeout_s: float = 600.0) -> "RemoteGeneration":
    """Iterate the result for text deltas (one per server response); then `.result` holds the statistics.

        generation = remote_generate("127.0.0.1:8001", "def fib(n):", cfg, stream=True)
        for delta in generation:
            print(delta, end="")
        generation.result["acceptance_rate"]

    `.result` has the in-process Result.as_dict() keys. `ttft_ms`, `total_ms` and `tokens_per_s` are
    measured here, end to end (the server's own are `server_ttft_ms`, ...); `chunk_ms` / `chunk_tokens`
    give each response's arrival time and token count, for inter-token latency; `perf` holds TensorRT-LLM's
    perf outputs (server wall-clock times in ns, acceptance counters).
    """
    return RemoteGeneration(url, request_tensors(prompt, cfg, stream=stream, chat=chat), model_name=model_name,
                            timeout_s=timeout_s)


def check_ready(url: str, model_name: str = DEFAULT_MODEL, timeout_s: float = 3.0) -> None:
    """Fail fast (ServerError) when nothing answers at `url` or the model is not ready to serve."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    try:
        client = grpcclient.InferenceServerClient(url)
    except Exception as exc:  # a malformed address
        raise ServerError(f"--url {url!r}: {exc}") from None
    try:
        if not client.is_server_live(client_timeout=timeout_s):
            raise ServerError(f"the Triton server at {url} is not live")
        if not client.is_model_ready(model_name, client_timeout=timeout_s):
            raise ServerError(f"the Triton server at {url} has no ready model {model_name!r} (see --model)")
    except InferenceServerException as exc:
        raise ServerError(f"cannot reach a Triton server at {url} within {timeout_s:g} s: {exc.message()}") from None
    finally:
        client.close()


def request_tensors(prompt: str, cfg: GenerationConfig, *, stream: bool, chat: bool = False) -> dict[str, np.ndarray]:
    """The request as numpy arrays with the batch dimension, TensorRT-LLM style ([1, 1] per scalar)."""
    return {
        "text_input": np.array([[require_text(prompt, "the prompt").encode("utf-8")]], dtype=np.object_),
        "max_tokens": np.array([[cfg.max_new_tokens]], dtype=np.int32),
        "stream": np.array([[stream]], dtype=bool),
        "exclude_input_in_output": np.array([[True]], dtype=bool),
        "return_perf_metrics": np.array([[True]], dtype=bool),
        "apply_chat_template": np.array([[chat]], dtype=bool),
        "generation_config": np.array([[cfg.model_dump_json().encode()]], dtype=np.object_),
    }


class RemoteGeneration:
    """One request (`tensors`: input name -> array) streamed from the server; see remote_generate().

    `client`: an open tritonclient.grpc client to send it on, kept open afterwards (a load generator holds one
    connection per user, as real clients do). Without one, the request opens its own, checks the server is
    live, and closes it.
    """

    def __init__(self, url: str, tensors: dict[str, np.ndarray], *, model_name: str = DEFAULT_MODEL,
                 timeout_s: float = 600.0, client=None):
        self.url, self.model_name, self.timeout_s = url, model_name, timeout_s
        self.tensors = tensors
        self.client = client
        self.result: Optional[dict] = None

    def __iter__(self) -> Iterator[str]:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException, np_to_triton_dtype

        own = self.client is None
        client = grpcclient.InferenceServerClient(self.url) if own else self.client
        finished = False
        try:
            if own:
                try:
                    client.is_server_live(client_timeout=10)
                except InferenceServerException as exc:
                    raise ServerError(f"cannot reach a Triton server at {self.url}: {exc.message()}") from None
            inputs = []
            for name, array in self.tensors.items():
                tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
                tensor.set_data_from_numpy(array)
                inputs.append(tensor)
            responses: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: responses.put((result, error)))
            started = time.perf_counter()
            client.async_stream_infer(self.model_name, inputs, enable_empty_final_response=True)
            yield from self._read(responses, started)
            finished = True
        finally:
            if own:
                client.close()
            else:
                # The stream must end before the client's next request; one cut short is cancelled, not awaited.
                client.stop_stream(cancel_requests=not finished)

    def _read(self, responses: queue.Queue, started: float) -> Iterator[str]:
        text, token_ids, chunk_ms, chunk_tokens, stats = [], [], [], [], {}
        while True:
            try:
                result, error = responses.get(timeout=self.timeout_s)
            except queue.Empty:
                raise ServerError(f"no response from {self.url} within {self.timeout_s:.0f} s") from None
            if error is not None:
                raise ServerError(f"the server refused the request: {error.message()}")
            now_ms = (time.perf_counter() - started) * 1e3
            delta = result.as_numpy("text_output")
            ids = result.as_numpy("token_ids")
            if ids is not None and ids.size:
                token_ids += ids.reshape(-1).tolist()
                chunk_ms.append(now_ms)
                chunk_tokens.append(int(ids.size))
            if delta is not None:
                piece = delta.reshape(-1)[0].decode("utf-8")
                if piece:
                    text.append(piece)
                    yield piece
            if result.get_response().parameters["triton_final_response"].bool_param:
                stats_json = result.as_numpy("stats_json")
                stats = json.loads(stats_json.reshape(-1)[0]) if stats_json is not None else {}
                perf = {name: result.as_numpy(name) for name in PERF_OUTPUTS}
                break
        total_ms = (time.perf_counter() - started) * 1e3
        server = {f"server_{key}": stats.get(key) for key in ("ttft_ms", "total_ms", "tokens_per_s", "decode_tokens_per_s")}
        self.result = {
            **stats,
            **server,
            "text": "".join(text),
            "token_ids": token_ids,
            "num_generated": len(token_ids),
            "ttft_ms": chunk_ms[0] if chunk_ms else total_ms,
            "total_ms": total_ms,
            "tokens_per_s": len(token_ids) / (total_ms / 1e3) if total_ms > 0 else 0.0,
            "chunk_ms": chunk_ms,
            "chunk_tokens": chunk_tokens,
            "perf": {name: value.reshape(-1)[0].item() for name, value in perf.items() if value is not None},
        }
