"""The gate through an OpenAI-compatible endpoint (trtllm-serve, vLLM, SGLang, llama.cpp, `specpipe serve
--openai-port`): `EndpointSubject`, so the greedy, distribution and latency checks run unchanged, and the
endpoint's own robustness check (bad HTTP requests refused with a 4xx and a message, the server still answers).

The reference the deployment must equal is either a build opened in this process (`--reference engines/NAME`:
the target's exact probabilities and logit margins, as in the other modes) or a second endpoint
(`--reference-endpoint`: the same server with speculation off, or the target served alone), or both (the
reference endpoint then runs the target-only side of the greedy and latency checks). What an endpoint does not
say (token ids, the drafts it accepted, the weights it runs) limits what can be checked; each limit is a line in
the report's `not_checked`.

Plain HTTP (urllib), so the gate needs no client library. Token ids come from vLLM's `return_token_ids`
extension (specpipe's front honours it too) when the server gives them; otherwise the checks compare text.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import numpy as np

from specpipe.errors import GateError, ServerError
from specpipe.gate.config import GateConfig
from specpipe.gate.report import CheckResult
from specpipe.gate.subjects import RequestTiming, Subject, answers_after_bad_requests, run_concurrently

ROBUSTNESS = "robustness"
# Alternatives per position asked of a reference endpoint for the distribution check, most first (vLLM's default
# cap is 20, OpenAI's legacy completions allow 5).
TOP_LOGPROBS = (20, 5)


@dataclass
class Completion:
    """One answered request: text, token ids when the server gives them, client-side timings."""

    text: str
    token_ids: Optional[list[int]]
    ttft_ms: float
    total_ms: float
    num_tokens: int
    finish_reason: Optional[str] = None
    speculation: dict = field(default_factory=dict)  # specpipe's front: drafted, accepted
    tokens: Optional[list[str]] = None  # completions' logprobs.tokens: the sampled tokens as text
    top_logprobs: Optional[list[dict[str, float]]] = None  # per position: token text -> log-probability


@dataclass
class Capabilities:
    """What the endpoint turned out to honour (found by probe())."""

    token_ids: bool = False  # return_token_ids
    usage_in_stream: bool = False  # stream_options.include_usage
    ignore_eos: bool = False
    specpipe: bool = False  # specpipe's front: num_draft_tokens and per-request speculation counts
    top_logprobs: int = 0  # completions' `logprobs` N it answers with N alternatives per position (0: none)


class EndpointClient:
    """POST to an OpenAI-compatible /v1: completions, or chat completions with one user message (`chat`)."""

    def __init__(self, base_url: str, model: str, *, chat: bool = False, extra: Optional[dict] = None,
                 api_key: Optional[str] = None, timeout_s: float = 300.0):
        self.base_url, self.model, self.chat = base_url.rstrip("/"), model, chat
        self.extra, self.api_key, self.timeout_s = dict(extra or {}), api_key, timeout_s
        self.caps = Capabilities()

    @property
    def route(self) -> str:
        return "/chat/completions" if self.chat else "/completions"

    def body(self, prompt: str, **fields) -> dict:
        body: dict[str, Any] = {"model": self.model, **self.extra}
        body.update({"messages": [{"role": "user", "content": prompt}]} if self.chat else {"prompt": prompt})
        if self.caps.token_ids:
            body["return_token_ids"] = True
        body.update({k: v for k, v in fields.items() if v is not None})
        return body

    def post(self, path: str, data: bytes, *, stream: bool = False):
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream" if stream else "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers, method="POST")
        return urllib.request.urlopen(request, timeout=self.timeout_s)

    def raw(self, body: bytes) -> tuple[int, str]:
        """(HTTP status, response text) of a request sent as is: robustness."""
        try:
            with self.post(self.route, body) as response:
                return response.status, response.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode("utf-8", "replace")

    def complete(self, prompt: str, *, max_tokens: int, stream: bool = False, **fields) -> Completion:
        if stream and self.caps.usage_in_stream:
            fields["stream_options"] = {"include_usage": True}
        body = self.body(prompt, max_tokens=max_tokens, stream=stream, **fields)
        started = time.perf_counter()
        try:
            with self.post(self.route, json.dumps(body).encode(), stream=stream) as response:
                if stream:
                    return self._read_stream(response, started)
                answer = json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise ServerError(f"{self.base_url} refused the request ({err.code}): {_error_message(err.read())}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
            raise ServerError(f"no answer from {self.base_url}: {getattr(err, 'reason', err)}") from None
        total_ms = (time.perf_counter() - started) * 1e3
        choice = answer["choices"][0]
        text = choice["message"]["content"] if self.chat else choice["text"]
        ids = choice.get("token_ids")
        tokens = (answer.get("usage") or {}).get("completion_tokens") or (len(ids) if ids is not None else 0)
        logprobs = choice.get("logprobs") if not self.chat else None
        return Completion(text or "", ids, total_ms, total_ms, int(tokens), choice.get("finish_reason"),
                          answer.get("specpipe") or {}, tokens=(logprobs or {}).get("tokens"),
                          top_logprobs=(logprobs or {}).get("top_logprobs"))

    def _read_stream(self, response, started: float) -> Completion:
        text, ids, chunks, ttft_ms, finish, usage, speculation = [], None, 0, None, None, None, {}
        for event in _events(response):
            if "error" in event:
                raise ServerError(f"{self.base_url} failed a streamed request: {_error_message(json.dumps(event).encode())}")
            usage = event.get("usage") or usage
            speculation = event.get("specpipe") or speculation
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
                if piece:
                    if ttft_ms is None:
                        ttft_ms = (time.perf_counter() - started) * 1e3
                    text.append(piece)
                    chunks += 1
                if choice.get("token_ids") is not None:
                    ids = (ids or []) + list(choice["token_ids"])
                finish = choice.get("finish_reason") or finish
        total_ms = (time.perf_counter() - started) * 1e3
        tokens = (usage or {}).get("completion_tokens") or (len(ids) if ids is not None else chunks)
        return Completion("".join(text), ids, ttft_ms if ttft_ms is not None else total_ms, total_ms, int(tokens), finish, speculation)

    def probe(self) -> Capabilities:
        """Find what the endpoint honours with a few 2-token requests; GateError when it answers none."""
        self.caps = Capabilities()
        try:
            plain = self.complete("Hello", max_tokens=2, temperature=0.0)
        except ServerError as err:
            raise GateError(f"--endpoint {self.base_url} model {self.model!r}: {err}") from None
        self.caps.specpipe = bool(plain.speculation)
        for name, fields in (("token_ids", {"return_token_ids": True}), ("ignore_eos", {"ignore_eos": True})):
            try:
                answer = self.complete("Hello", max_tokens=2, temperature=0.0, **fields)
            except ServerError:
                continue
            setattr(self.caps, name, answer.token_ids is not None if name == "token_ids" else True)
        try:
            streamed = self.complete("Hello", max_tokens=2, temperature=0.0, stream=True, stream_options={"include_usage": True})
            self.caps.usage_in_stream = streamed.num_tokens > 0
        except ServerError:
            pass
        for n in TOP_LOGPROBS if not self.chat else ():
            try:
                answer = self.complete("Hello", max_tokens=2, temperature=0.0, logprobs=n)
            except ServerError:
                continue
            if answer.tokens and answer.top_logprobs and len(answer.top_logprobs[0] or {}) > 1:
                self.caps.top_logprobs = n
                break
        return self.caps


def _events(response) -> Iterator[dict]:
    """The JSON events of a server-sent event stream, up to `data: [DONE]`."""
    for raw in response:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _error_message(raw: bytes) -> str:
    """OpenAI's {"error": {"message"}}, FastAPI's {"detail"}, or the text itself, on one line."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return " ".join(text.split())[:300]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if data.get("detail"):
            return json.dumps(data["detail"])[:300]
        if data.get("message"):
            return str(data["message"])
    return text[:300]


class EndpointSubject(Subject):
    """A deployment behind an OpenAI-compatible endpoint. `reference`: the build opened in this process, or None;
    `reference_client`: the reference endpoint, or None. Greedy requests send temperature 0; K cannot be chosen
    through a third-party endpoint, so the speculative side runs as deployed (specpipe's own front takes K)."""

    mode = "endpoint"

    def __init__(self, client: EndpointClient, reference=None, reference_client: Optional[EndpointClient] = None, *,
                 gate: Optional[GateConfig] = None):
        if reference is None and reference_client is None:
            raise GateError("--endpoint needs a reference: --reference engines/NAME (the target in this process) "
                            "and/or --reference-endpoint URL (the same server with speculation off)")
        self.client, self.reference, self.reference_client, self.chat = client, reference, reference_client, client.chat
        self.gate = gate or GateConfig()
        self.caps = client.probe()
        self.reference_caps = reference_client.probe() if reference_client is not None else None
        self.tables: dict[str, "TokenTable"] = {}  # the log-probability path: context -> its token texts

    # -- what the checks ask ----------------------------------------------------------------------
    @property
    def token_ids(self) -> bool:
        """Both sides of the greedy check give token ids (else it compares text)."""
        return self.caps.token_ids and (self.reference_client is None or self.reference_caps.token_ids)

    def without_draft(self) -> bool:
        return False  # an endpoint does not say; thresholds on what a draft adds are applied

    def unsupported(self, check: str) -> Optional[str]:
        if check == "quantization_accuracy":
            return "not checkable through an endpoint: the weights it serves are not visible through it"
        if check == "distribution_equivalence" and not self.exact_distribution:
            return self._no_logprob_path()
        return None

    @property
    def exact_distribution(self) -> bool:
        """The target's whole p from --reference, and the sampled token ids from the endpoint."""
        return self.reference is not None and self.caps.token_ids

    def _no_logprob_path(self) -> Optional[str]:
        """Why the test on the reference endpoint's top log-probabilities cannot run (None: it can)."""
        if self.reference is None and self.reference_client is None:
            return "needs the target's probabilities: --reference engines/NAME or a --reference-endpoint"
        if self.reference is not None and self.reference_client is None:
            return "the endpoint does not return the token ids it sampled (vLLM's return_token_ids)"
        if self.chat:
            return "through an endpoint without token ids it runs on /v1/completions only (the gate has chat = true)"
        if not self.reference_caps.top_logprobs:
            return "the reference endpoint returns no top log-probabilities (completions' `logprobs`)"
        if not self.caps.top_logprobs:
            return "the endpoint returns neither the token ids nor the tokens it sampled (completions' `logprobs`)"
        if self.gate.distribution.top_p < 1.0:
            return "top_p < 1 needs the target's whole distribution; the reference endpoint gives its top tokens only"
        return None

    def distribution_cases(self, gate, budget):
        if self.exact_distribution:
            return super().distribution_cases(gate, budget)
        return [self._logprob_case(context, temperature, budget) for context, temperature in distribution_case_list(gate)]

    def _logprob_case(self, context: str, temperature: float, budget: int):
        """p of the first two tokens from the reference endpoint's top log-probabilities, tempered and truncated as the
        samples are, conditional on those top tokens (a sample outside them is not tested; with top_k within them, it
        is impossible). x* = the reference's greedy first token."""
        from specpipe.contract.generation import SamplingConfig
        from specpipe.gate.distribution import Case
        from specpipe.speculative.sampling import shape_probs

        cfg = self.gate.distribution
        if context not in self.tables:
            answer = self.reference_client.complete(context, max_tokens=2, temperature=0.0, logprobs=self.reference_caps.top_logprobs)
            positions = [dict(top or {}) for top in (answer.top_logprobs or [])][:2]
            if not positions or not answer.tokens:
                raise ServerError(f"the reference endpoint returned no log-probabilities for {context!r}")
            outside_impossible = 0 < cfg.top_k <= self.reference_caps.top_logprobs
            self.tables[context] = TokenTable([list(top) for top in positions], answer.tokens[0], outside_impossible,
                                              [np.array(list(top.values()), dtype=np.float64) for top in positions])
        table = self.tables[context]
        sampling = SamplingConfig(temperature=temperature, top_k=cfg.top_k, top_p=cfg.top_p)
        p = [shape_probs(np.append(logprobs, -np.inf), sampling)[0] for logprobs in table.logprobs]  # [N + 1]: the last is "outside"
        p_second = p[1] if len(p) > 1 else np.array([1.0, 0.0])
        x_star = table.index(0, table.greedy_first)
        return Case(context, temperature, sampling, p[0], x_star if x_star >= 0 else 0, p_second, budget)

    def limitations(self) -> list[str]:
        notes = []
        if not self.exact_distribution and self._no_logprob_path() is None:
            table = f"its top {self.reference_caps.top_logprobs} tokens"
            notes.append(f"distribution_equivalence: tested on the reference endpoint's log-probabilities, conditional on {table} per "
                         "position (sampled tokens outside them are not tested), not on the target's whole distribution")
        if not self.caps.specpipe:
            notes.append("K is not chosen through this endpoint: the greedy and distribution checks sample the speculative "
                         "side as deployed, not at the gate's num_draft_tokens / draft_lengths")
            notes.append("acceptance (drafted/accepted tokens) is not reported by this endpoint: acceptance_rate_min not applied")
        if not self.token_ids:
            notes.append("token ids are not returned: greedy equivalence compares text, without the near-tie rule")
        elif self.reference is None:
            notes.append("no --reference build: a greedy mismatch cannot be told from a numerical near-tie")
        if self.reference_client is None:
            notes.append("no --reference-endpoint: target-only latency is not measured, so speedup_min is not applied")
        if not self.caps.ignore_eos:
            notes.append("ignore_eos is not honoured: a distribution sample that ends at EOS has fewer than two tokens")
        if not self.caps.usage_in_stream and not self.caps.token_ids:
            notes.append("streamed responses carry no token counts: a token is counted per streamed chunk")
        return notes

    # -- the speculative side (the endpoint) and the reference -----------------------------------
    def _side(self, num_draft_tokens: Optional[int]) -> tuple[EndpointClient, dict]:
        """K None: the endpoint as deployed; 0: the reference endpoint; K: the endpoint (with K where it takes it)."""
        if num_draft_tokens == 0 and self.reference_client is not None:
            return self.reference_client, {}
        if num_draft_tokens and self.caps.specpipe:
            return self.client, {"num_draft_tokens": num_draft_tokens}
        return self.client, {}

    def greedy_completion(self, prompt: str, max_new_tokens: int, num_draft_tokens: int) -> Completion:
        if num_draft_tokens == 0 and self.reference_client is None:  # the target alone, in this process
            cfg = self.reference.decoding.request(0, max_new_tokens=max_new_tokens)
            result = self.reference.generator.generate(self.encode(prompt), cfg)
            return Completion(result.text, result.token_ids, result.ttft_ms, result.total_ms, result.num_generated)
        client, fields = self._side(num_draft_tokens)
        return client.complete(prompt, max_tokens=max_new_tokens, temperature=0.0, **fields)

    def greedy_ids(self, prompt, max_new_tokens, num_draft_tokens):
        ids = self.greedy_completion(prompt, max_new_tokens, num_draft_tokens).token_ids
        if ids is None:
            raise GateError("the endpoint returned no token ids; compare text (greedy.check_greedy_text)")
        return list(ids)

    def first_two(self, context, sampling, n, draft_lengths, seed, tick, *, concurrency: int = 2):
        extra: dict[str, Any] = {"ignore_eos": True} if self.caps.ignore_eos else {}
        if sampling.top_k:
            extra["top_k"] = sampling.top_k

        table = None if self.exact_distribution else self.tables[context]
        if table is not None:
            extra["logprobs"] = 1  # the sampled tokens, as text

        def one(i: int) -> list[int]:
            k = draft_lengths[i % len(draft_lengths)]
            fields = {**extra, **({"num_draft_tokens": k} if self.caps.specpipe else {})}
            answer = self.client.complete(context, max_tokens=2, temperature=sampling.temperature, top_p=sampling.top_p,
                                          seed=seed + i, **fields)
            tick(1)
            if table is not None:
                return [table.index(position, token) for position, token in enumerate((answer.tokens or [])[:2])] + \
                    [-1] * (2 - len((answer.tokens or [])[:2]))
            return (list(answer.token_ids or []) + [-1, -1])[:2]

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return np.array(list(pool.map(one, range(n))), dtype=np.int64)

    def timed_run(self, prompts, max_new_tokens, num_draft_tokens, concurrency, requests, warmup, tick):
        """Streaming requests, `concurrency` users; None when the side cannot run here (no reference endpoint)."""
        if num_draft_tokens == 0 and self.reference_client is None:
            return None
        client, fields = self._side(num_draft_tokens)
        if client is self.reference_client:
            fields = {}

        def one(i: int) -> RequestTiming:
            answer = client.complete(prompts[i % len(prompts)], max_tokens=max_new_tokens, temperature=0.0, stream=True, **fields)
            spec = answer.speculation
            return RequestTiming(ttft_ms=answer.ttft_ms, total_ms=answer.total_ms, num_tokens=answer.num_tokens,
                                 drafted=int(spec.get("drafted", 0)), accepted=int(spec.get("accepted", 0)))

        return run_concurrently(one, concurrency, requests, warmup, tick)


@dataclass
class TokenTable:
    """One context's first two positions as the reference endpoint gave them: the top token texts (index i = the
    i-th; index N = any other token), their log-probabilities, and the greedy first token."""

    texts: list[list[str]]  # [position][i]
    greedy_first: str
    outside_impossible: bool  # top_k within the top tokens: a token outside them cannot be sampled
    logprobs: list[np.ndarray]  # [position] -> [N]

    def index(self, position: int, token: str) -> int:
        if position >= len(self.texts):
            return -1
        texts = self.texts[position]
        if token in texts:
            return texts.index(token)
        return len(texts) if self.outside_impossible else -1  # -1: not tested (conditional on the top tokens)


def distribution_case_list(gate: GateConfig) -> list[tuple[str, float]]:
    from specpipe.gate.distribution import cases

    return cases(gate.distribution)


def bad_requests(model: str, chat: bool) -> dict[str, bytes]:
    """Requests every OpenAI-compatible server must refuse with a 4xx and a message: name -> body."""
    prompt = {"messages": [{"role": "user", "content": "Hello"}]} if chat else {"prompt": "Hello"}

    def body(**changes) -> bytes:
        data = {"model": model, **prompt, "max_tokens": 4, **changes}
        return json.dumps({k: v for k, v in data.items() if v is not None}).encode()

    return {
        "body is not JSON": b'{"model": ' + json.dumps(model).encode() + b", not json",
        ("messages missing" if chat else "prompt missing"): body(**{("messages" if chat else "prompt"): None}),
        "max_tokens negative": body(max_tokens=-5),
        "max_tokens not a number": body(max_tokens="four"),
        "max_tokens 10^8 (beyond any context)": body(max_tokens=10**8),
        "temperature negative": body(temperature=-1.0),
    }


def check_robustness(subject: EndpointSubject, gate: GateConfig, tick) -> CheckResult:
    failures, refused = [], {}
    for name, body in bad_requests(subject.client.model, subject.chat).items():
        try:
            status, text = subject.client.raw(body)
        except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
            status, text = None, f"no answer: {getattr(err, 'reason', err)}"
        message = _error_message(text.encode()) if status is not None and 400 <= status < 500 else None
        refused[name] = f"{status}: {message}" if message else None
        if status is None or status >= 500:
            failures.append(f"{name}: not a clean refusal ({status or 'no answer'}: {text[:200]})")
        elif status < 400:
            failures.append(f"{name}: accepted ({status})")
        elif not message:
            failures.append(f"{name}: refused ({status}) without a message")
        tick(1)
    still_serving = answers_after_bad_requests(
        lambda: subject.client.complete(gate.prompts[0], max_tokens=8, temperature=0.0).text, failures)
    tick(1)
    summary = (f"{sum(m is not None for m in refused.values())}/{len(refused)} bad requests refused with a 4xx and a message;"
               f" endpoint {'still answers' if still_serving else 'does NOT answer'} afterwards")
    return CheckResult(ROBUSTNESS, "failed" if failures else "passed", summary, failures, [],
                       {"refused": refused, "still_serving": still_serving})
