"""An OpenAI-compatible HTTP front (`/v1/completions`, `/v1/chat/completions`, `/v1/models`) over a running Triton
server of specpipe's repository, as Triton's own OpenAI frontend and trtllm-serve put one before theirs.

Each HTTP request becomes one gRPC streaming request (specpipe.triton.client) with tensorrtllm_backend's tensor
names only, so the served model decodes with its deployment's own settings (adaptive K, the batch plan) and
the request's sampling; the served model checks every value, and its refusal comes back as an HTTP 400 with
OpenAI's error body. The nvidia-pytriton wheel has no OpenAI frontend of its own (it ships no `tritonserver`
Python module), hence this one.

What maps to what (request body -> served model input -> GenerationConfig):

    max_tokens (chat: max_completion_tokens too)  -> max_tokens       -> max_new_tokens
    temperature (OpenAI's default 1.0; 0 = greedy) -> temperature      -> sampling.temperature
    top_p, top_k (vLLM's extension)                -> top_p, top_k     -> sampling.top_p, sampling.top_k
    seed                                           -> seed             -> seed
    stop (a string or a list)                      -> stop_words       -> stop
    ignore_eos (vLLM's extension)                  -> end_id -1        -> stop_on_eos False
    num_draft_tokens (specpipe's extension)        -> num_draft_tokens -> None: as deployed; 0: the target alone;
                                                                          K: exactly K drafts a step
    a chat with one user message                   -> apply_chat_template (the server applies the template)
    return_token_ids (vLLM's extension)            -> each choice carries `token_ids`

n > 1, logprobs, echo, best_of > 1, non-zero penalties and logit_bias are refused with a message; a field
OpenAI does not define and specpipe does not take is refused too (OpenAI's "Unrecognized request argument").
Each response also carries `specpipe`: the request's drafted and accepted draft tokens.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specpipe.config import Strict
from specpipe.contract.generation import GenerationConfig
from specpipe.errors import ServerError

MAX_BODY_BYTES = 1 << 20


class OpenAIConfig(Strict):
    """`specpipe serve --openai-port`: where the OpenAI-compatible front listens."""

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(ge=0, le=65535, description="HTTP port of /v1 (0 = any free port); off unless given")
    request_timeout_s: float = Field(600.0, gt=0, description="longest wait for the next token of a request")


class _Request(BaseModel):
    """What both endpoints take. OpenAI's defaults: temperature 1, top_p 1, n 1."""

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="vLLM's extension; 0 = off")
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    num_draft_tokens: Optional[int] = Field(None, ge=0, description="specpipe: None = as deployed, 0 = target alone, K = fixed")

    def unsupported(self) -> Optional[str]:
        """The first value specpipe cannot honour, as a message; None when every one is honoured."""
        if self.n != 1:
            return f"n must be 1, got {self.n}"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty and frequency_penalty are not supported (send 0)"
        if self.logit_bias:
            return "logit_bias is not supported"
        return None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Request):
    prompt: Union[str, list[str]]
    max_tokens: int = Field(16, ge=1, description="OpenAI's default for completions")
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def unsupported(self) -> Optional[str]:
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            return f"prompt must be one string, got a list of {len(self.prompt)}"
        if self.logprobs:
            return "logprobs are not available: specpipe's served model does not return log-probabilities"
        if self.echo:
            return "echo is not supported"
        if self.best_of not in (None, 1):
            return "best_of must be 1"
        if self.suffix:
            return "suffix is not supported"
        return super().unsupported()

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None

    def plain_text(self) -> str:
        if isinstance(self.content, list):  # content parts: text parts only
            if any(part.get("type") != "text" for part in self.content):
                raise ValueError("only text content parts are supported")
            return "".join(part.get("text", "") for part in self.content)
        return self.content or ""


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None

    def unsupported(self) -> Optional[str]:
        if self.logprobs or self.top_logprobs:
            return "logprobs are not available: specpipe's served model does not return log-probabilities"
        return super().unsupported()

    @property
    def new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or GenerationConfig.model_fields["max_new_tokens"].default


class ApiError(Exception):
    """An OpenAI-style error: HTTP status and {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def parse_body(raw: bytes, model: type[_Request]) -> _Request:
    try:
        data = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(part) for part in err["loc"])
        message = "unrecognized request argument" if err["type"] == "extra_forbidden" else err["msg"]
        raise ApiError(400, f"{where}: {message}" + (f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""),
                       param=where) from None
    problem = request.unsupported()
    if problem:
        raise ApiError(400, problem)
    return request


class Front:
    """The mapping from OpenAI requests to Triton requests, for the served models `models` (OpenAI id = Triton name).

    `tokenizers`: model -> its tokenizer, to render chats that are more than one user message."""

    def __init__(self, triton_url: str, models: list[str], *, tokenizers: Optional[dict] = None, timeout_s: float = 600.0):
        self.triton_url, self.models, self.tokenizers, self.timeout_s = triton_url, models, tokenizers or {}, timeout_s
        self.created = int(time.time())

    def model_list(self) -> dict:
        return {"object": "list", "data": [{"id": m, "object": "model", "created": self.created, "owned_by": "specpipe"}
                                           for m in self.models]}  # fmt: skip

    def tensors(self, request: _Request, prompt: str, chat: bool, max_tokens: int) -> dict[str, np.ndarray]:
        if request.model not in self.models:
            raise ApiError(404, f"the model {request.model!r} does not exist; served: {', '.join(self.models)}",
                           param="model", kind="not_found_error")
        tensors = {
            "text_input": np.array([[prompt.encode("utf-8")]], dtype=np.object_),
            "max_tokens": np.array([[max_tokens]], dtype=np.int32),
            "temperature": np.array([[request.temperature]], dtype=np.float32),
            "top_p": np.array([[request.top_p]], dtype=np.float32),
            "top_k": np.array([[request.top_k]], dtype=np.int32),
            "stream": np.array([[True]], dtype=bool),
            "exclude_input_in_output": np.array([[True]], dtype=bool),
            "return_perf_metrics": np.array([[True]], dtype=bool),
            "apply_chat_template": np.array([[chat]], dtype=bool),
        }
        if request.seed is not None:
            tensors["seed"] = np.array([[request.seed % (1 << 64)]], dtype=np.uint64)
        if request.stops:
            tensors["stop_words"] = np.array([[s.encode("utf-8") for s in request.stops]], dtype=np.object_)
        if request.ignore_eos:
            tensors["end_id"] = np.array([[-1]], dtype=np.int32)
        if request.num_draft_tokens is not None:
            tensors["num_draft_tokens"] = np.array([[request.num_draft_tokens]], dtype=np.int32)
        return tensors

    def chat_prompt(self, request: ChatRequest) -> tuple[str, bool]:
        """(text, apply the template on the server): one user message is templated by the server, exactly as
        `generate --chat`; a longer chat is rendered here with the same tokenizer."""
        try:
            texts = [(m.role, m.plain_text()) for m in request.messages]
        except ValueError as exc:
            raise ApiError(400, f"messages: {exc}") from None
        if len(texts) == 1 and texts[0][0] == "user":
            return texts[0][1], True
        tokenizer = self.tokenizers.get(request.model)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template for more than one message")
        text = tokenizer.apply_chat_template([{"role": r, "content": t} for r, t in texts], add_generation_prompt=True,
                                             tokenize=False)
        bos = tokenizer.bos_token
        if bos and text.startswith(bos) and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]:
            text = text[len(bos):]  # the server's tokenizer adds it again
        return text, False


def _finish(result: dict) -> str:
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(result.get("finish_reason", ""), "stop")


def _usage(result: dict) -> dict:
    prompt = int(result.get("prompt_len") or 0)
    completion = int(result.get("num_generated") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _speculation(result: dict) -> dict:
    return {"drafted": int(result.get("drafted") or 0), "accepted": int(result.get("accepted") or 0)}


class _Handler(BaseHTTPRequestHandler):
    server_version = "specpipe-openai"
    protocol_version = "HTTP/1.1"
    front: Front  # set on the subclass made per server

    def log_message(self, format, *args):  # noqa: A002 - quiet: the Triton log has the requests
        pass

    # -- plumbing --------------------------------------------------------------------------------
    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:  # say so: a client that keeps the connection would send its next request into a
            self.send_header("Connection", "close")  # socket this server is closing ("Server disconnected")
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        return self.rfile.read(length) if length > 0 else b""

    def do_GET(self):  # noqa: N802
        if self.path.rstrip("/") == "/v1/models":
            self._json(200, self.front.model_list())
        elif self.path.rstrip("/") in ("/health", "/v1/health"):
            self._json(200, {"status": "ok"})
        else:
            self._json(404, ApiError(404, f"no route {self.path}", kind="not_found_error").body())

    def do_POST(self):  # noqa: N802
        path = self.path.rstrip("/")
        try:
            body = self._body()
            if path == "/v1/completions":
                request = parse_body(body, CompletionRequest)
                prompt, chat, max_tokens = request.text, False, request.max_tokens
            elif path == "/v1/chat/completions":
                request = parse_body(body, ChatRequest)
                (prompt, chat), max_tokens = self.front.chat_prompt(request), request.new_tokens
            else:
                raise ApiError(404, f"no route {self.path}", kind="not_found_error")
            tensors = self.front.tensors(request, prompt, chat, max_tokens)
        except ApiError as err:
            self.close_connection = True
            self._json(err.status, err.body())
            return
        self._answer(request, tensors, chat=path.endswith("chat/completions"))

    def _answer(self, request: _Request, tensors: dict, *, chat: bool) -> None:
        from specpipe.triton.client import RemoteGeneration

        generation = RemoteGeneration(self.front.triton_url, tensors, model_name=request.model, timeout_s=self.front.timeout_s)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        pieces = iter(generation)
        try:  # the first response decides: a refusal is an HTTP error, before any byte of a stream is sent
            first = next(pieces, None)
            if not request.stream:
                text = (first or "") + "".join(pieces)
                self._json(200, self._whole(request, generation.result, text, ident, created, kind, chat))
                return
        except ServerError as err:
            self.close_connection = True
            refused = str(err).startswith("the server refused the request: ")
            message = str(err).removeprefix("the server refused the request: ").strip()
            error = ApiError(400, message) if refused else ApiError(502, message, kind="server_error")
            self._json(error.status, error.body())
            return
        self._stream(request, generation, pieces, first, ident, created, chat)

    def _whole(self, request, result: dict, text: str, ident: str, created: int, kind: str, chat: bool) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(result), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if request.return_token_ids:
            choice["token_ids"] = result["token_ids"]
        return {"id": ident, "object": kind, "created": created, "model": request.model, "choices": [choice],
                "usage": _usage(result), "specpipe": _speculation(result)}  # fmt: skip

    def _stream(self, request, generation, pieces, first, ident: str, created: int, chat: bool) -> None:
        """Server-sent events, one per server response, `data: [DONE]` last (chunked transfer encoding)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")  # closed after the stream (below): the client must not reuse it
        self.end_headers()
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(delta: Optional[str], finish: Optional[str] = None, **extra) -> dict:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["delta"] = {} if delta is None else {"content": delta}
            else:
                choice["text"] = delta or ""
            return {"id": ident, "object": kind, "created": created, "model": request.model, "choices": [choice], **extra}

        try:
            if chat:
                self._send(event(None) | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                       "finish_reason": None, "logprobs": None}]})
            for piece in ([first] if first else []):
                self._send(event(piece))
            for piece in pieces:
                self._send(event(piece))
            result = generation.result
            last = event(None if chat else "", _finish(result), specpipe=_speculation(result))
            if request.return_token_ids:
                last["choices"][0]["token_ids"] = result["token_ids"]
            self._send(last)
            if (request.stream_options or {}).get("include_usage"):
                self._send({"id": ident, "object": kind, "created": created, "model": request.model, "choices": [],
                            "usage": _usage(result)})
            self._chunk(b"data: [DONE]\n\n")
        except ServerError as err:  # after the stream began: an error event, as vLLM sends one
            self._send(ApiError(500, str(err), kind="server_error").body())
            self._chunk(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            return  # the client went away; RemoteGeneration's stream was cancelled with the generator
        self._chunk(b"")
        self.close_connection = True

    def _send(self, event: dict) -> None:
        self._chunk(b"data: " + json.dumps(event).encode() + b"\n\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


class OpenAIServer:
    """The front on a thread of this process: `with OpenAIServer(front, cfg) as api: api.url` ('http://host:port/v1')."""

    def __init__(self, front: Front, config: Optional[OpenAIConfig] = None):
        self.front, self.config = front, config or OpenAIConfig(port=0)
        handler = type("Handler", (_Handler,), {"front": front})
        try:
            self.httpd = ThreadingHTTPServer((self.config.host, self.config.port), handler)
        except OSError as exc:
            raise ServerError(f"cannot listen on {self.config.host}:{self.config.port} for the OpenAI API: {exc.strerror}") from None
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="openai-front", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/v1"

    def start(self) -> "OpenAIServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "OpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def front_for_repository(repo, triton_url: str, timeout_s: float = 600.0) -> Front:
    """A Front for every specpipe model of `repo` served with tensorrt_llm_bls's tensors (the front sends those);
    a model served with the llmapi model's shapes, or not specpipe's, is left out."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from specpipe.drafts import read_manifest
    from specpipe.triton.model_config import read_config
    from specpipe.triton.repository import served_engine_dir

    models, tokenizers = [], {}
    for model_dir in sorted(p for p in Path(repo).iterdir() if (p / "config.pbtxt").is_file()):
        protocol = read_config(model_dir).parameters.get("protocol")
        if protocol is not None and protocol.string_value != "tensorrtllm_backend":
            continue
        try:
            engines = served_engine_dir(Path(repo), model_dir.name)
            manifest = read_manifest(engines)
        except Exception:  # noqa: BLE001 - not a specpipe model (an ensemble step, an upstream model)
            continue
        models.append(model_dir.name)
        tokenizers[model_dir.name] = AutoTokenizer.from_pretrained(str(engines / manifest.tokenizer.path))
    if not models:
        raise ServerError(f"{repo} holds no specpipe model to serve through the OpenAI API")
    return Front(triton_url, models, tokenizers=tokenizers, timeout_s=timeout_s)
