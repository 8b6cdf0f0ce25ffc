"""`specpipe serve --openai-port` (the OpenAI API in front of the Triton deployment) and `specpipe validate
--endpoint` (the gate through any OpenAI-compatible server), on the tiny pair.

One `specpipe serve` for the module, started as a user starts it. The planted faults sit in a proxy between the
gate and that server: one returns other tokens than the server sampled, one returns text without token ids.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import specpipe
from specpipe.triton import free_port, free_ports
from tests.test_gate import _toml, one_line_error, small_gate, validate, write_toml

pytestmark = pytest.mark.timing
PROJECT_ROOT = Path(specpipe.__file__).resolve().parents[1]
MODEL = "ensemble"


@pytest.fixture(scope="module")
def served(tiny_build, tmp_path_factory):
    """(OpenAI base URL, engines folder) of `specpipe serve REPO --openai-port PORT` on the tiny pair."""
    from specpipe.triton import write_repository

    repo = tmp_path_factory.mktemp("openai_repo")
    write_repository(tiny_build, repo, instance_count=2)
    grpc_port, http_port, metrics_port, port = free_ports(4)
    cmd = [sys.executable, "-m", "specpipe", "serve", str(repo), "--grpc-port", str(grpc_port), "--http-port",
           str(http_port), "--metrics-port", str(metrics_port), "--openai-port", str(port), "--timeout", "300"]
    process = subprocess.Popen(cmd, cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(process.stderr.readline, "")), daemon=True).start()
    deadline = time.time() + 360
    while not any("ready in" in line for line in lines):
        assert process.poll() is None, "".join(lines)
        assert time.time() < deadline, "".join(lines)
        time.sleep(0.1)
    assert f"OpenAI API http://127.0.0.1:{port}/v1" in "".join(lines)
    yield f"http://127.0.0.1:{port}/v1", tiny_build
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)


# ---- the API itself ----------------------------------------------------------------------------


def test_openai_fields_map_onto_the_generation_config():
    """Body -> the served model's tensors -> the GenerationConfig fields the served model decodes with."""
    from specpipe.triton.openai_api import CompletionRequest, Front, parse_body
    from specpipe.triton.protocol import parse_request

    body = {"model": MODEL, "prompt": "p", "max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 11,
            "stop": "\n\n", "ignore_eos": True, "num_draft_tokens": 3}
    request = parse_body(json.dumps(body).encode(), CompletionRequest)
    served = parse_request(Front("unused", [MODEL]).tensors(request, request.text, False, request.max_tokens))
    assert served.prompt == "p" and served.stream and served.end_id == -1 and not served.chat
    assert served.config == {"max_new_tokens": 9, "sampling": {"temperature": pytest.approx(0.7), "top_k": 5,
                                                               "top_p": pytest.approx(0.9)},
                             "seed": 11, "speculative": True, "num_draft_tokens": 3, "draft_length": "fixed", "stop": ["\n\n"]}
    plain = parse_request(Front("unused", [MODEL]).tensors(parse_body(b'{"model": "ensemble", "prompt": "p"}', CompletionRequest),
                                                          "p", False, 16))
    assert plain.config["sampling"]["temperature"] == 1.0 and "num_draft_tokens" not in plain.config  # OpenAI's default; as deployed


def test_the_front_serves_the_models_with_tensorrt_llm_bls_tensors(tiny_build, tmp_path):
    from specpipe.triton import write_repository
    from specpipe.triton.openai_api import front_for_repository

    write_repository(tiny_build, tmp_path / "repo")
    write_repository(tiny_build, tmp_path / "repo", model_name="tensorrt_llm", protocol="llmapi")  # rank-1 shapes
    assert front_for_repository(tmp_path / "repo", "unused").models == [MODEL]


def test_openai_client_lists_completes_and_streams(served):
    url, build = served
    client = _client(url)
    assert [m.id for m in client.models.list()] == [MODEL]

    whole = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True})
    choice = whole.choices[0]
    assert choice.finish_reason in ("stop", "length") and whole.usage.completion_tokens == len(choice.model_extra["token_ids"])
    assert set(whole.model_extra["specpipe"]) == {"drafted", "accepted"}

    streamed = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=12, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == choice.text  # greedy: the same text, streamed

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, seed=7,
                                          temperature=0.8, stream=True, stream_options={"include_usage": True})
    chunks = list(chat)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, seed=7,
                                           temperature=0.8)
    assert again.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_bad_requests_are_openai_errors_and_the_server_keeps_answering(served):
    import openai

    url, _ = served
    client = _client(url)
    for kwargs, status, needle in (
        (dict(max_tokens=-1), 400, "max_tokens"),
        (dict(max_tokens=100_000), 400, "max_seq_len"),  # the served model's own refusal, passed on
        (dict(n=2), 400, "n must be 1"),
        (dict(logprobs=2), 400, "logprobs are not available"),
        (dict(extra_body={"not_a_field": 1}), 400, "unrecognized request argument"),
        (dict(model="no-such-model"), 404, "does not exist"),
    ):
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(**{"model": MODEL, "prompt": "x", "max_tokens": 2, **kwargs})
        assert err.value.status_code == status and needle in err.value.message, (kwargs, err.value.message)
    request = urllib.request.Request(url + "/completions", data=b"{not json", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=60)
    assert err.value.code == 400 and "not valid JSON" in json.loads(err.value.read())["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).choices[0].text is not None


# ---- the gate through the endpoint -------------------------------------------------------------


def _gate(tmp_path, **sections) -> Path:
    return write_toml(tmp_path / "gate.toml", _toml(small_gate(**sections)))


def test_validate_endpoint_passes_and_says_what_it_could_not_check(served, tmp_path, capsys):
    url, build = served
    code, out, err = validate(capsys, "--endpoint", url, "--model", MODEL, "--reference", build, "--reference-endpoint", url,
                              "--reference-extra", '{"num_draft_tokens": 0}', "--gate", _gate(tmp_path),
                              "--report-dir", tmp_path / "r", "--quiet", "--json")
    assert code == 0, out + err
    report = json.loads(out)
    assert report["mode"] == "endpoint" and report["passed"]
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status == {"greedy_equivalence": "passed", "distribution_equivalence": "passed", "quantization_accuracy": "skipped",
                      "latency_slo": "passed", "robustness": "passed"}
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["distribution_equivalence"]["metrics"]["samples_per_case"] == [300, 300]
    assert checks["latency_slo"]["metrics"]["speedup"] is not None and set(checks["latency_slo"]["metrics"]["runs"]) == {
        "speculative", "target_only"}
    assert all(checks["robustness"]["metrics"]["refused"].values())
    assert any(line.startswith("quantization_accuracy: not checkable through an endpoint") for line in report["not_checked"])
    assert "not checked through this subject" in (tmp_path / "r" / "report.html").read_text()


def test_validate_endpoint_with_only_a_reference_endpoint(served, tmp_path, capsys):
    url, _ = served
    code, out, err = validate(capsys, "--endpoint", url, "--model", MODEL, "--reference-endpoint", url, "--reference-extra",
                              '{"num_draft_tokens": 0}', "--gate", _gate(tmp_path, latency={"enabled": False}),
                              "--report-dir", tmp_path / "r", "--quiet")
    assert code == 0, out + err
    assert "SKIPPED distribution_equivalence: the reference endpoint returns no top log-probabilities" in out
    assert "NOT CHECKED no --reference build: a greedy mismatch cannot be told from a numerical near-tie" in out


class _Proxy:
    """Forwards to `upstream`; `fault` rewrites non-streamed answers: "other-tokens" (the last token id and its text
    replaced) or "text-only" (token ids dropped)."""

    def __init__(self, upstream: str, fault: str):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                self._forward(None)

            def do_POST(self):  # noqa: N802
                self._forward(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

            def _forward(self, body):
                request = urllib.request.Request(upstream + self.path.removeprefix("/v1"), data=body, method=self.command,
                                                 headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(request, timeout=300) as response:
                        status, data, kind = response.status, response.read(), response.headers.get("Content-Type")
                except urllib.error.HTTPError as err:
                    status, data, kind = err.code, err.read(), "application/json"
                if status == 200 and kind == "application/json" and body and b'"stream": true' not in body:
                    data = proxy.rewrite(json.loads(data))
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.fault = fault
        self.httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def rewrite(self, answer: dict) -> bytes:
        for choice in answer.get("choices", []):
            ids = choice.get("token_ids")
            if self.fault == "text-only":
                choice.pop("token_ids", None)
            elif ids and self.fault == "other-tokens" and len(ids) > 2:
                choice["token_ids"] = ids[:-1] + [(ids[-1] + 7) % 200 + 10]
                choice["text"] = choice["text"] + "?"
        return json.dumps(answer).encode()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_validate_endpoint_fails_on_a_server_returning_other_tokens(served, tmp_path, capsys):
    url, build = served
    proxy = _Proxy(url, "other-tokens")
    try:
        code, out, err = validate(capsys, "--endpoint", proxy.url, "--model", MODEL, "--reference", build, "--gate",
                                  _gate(tmp_path, distribution={"enabled": False}, latency={"enabled": False}),
                                  "--report-dir", tmp_path / "r", "--quiet")
    finally:
        proxy.close()
    assert code == 1, out + err
    assert "gate failed: greedy_equivalence" in one_line_error(err)
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    greedy = next(c for c in report["checks"] if c["name"] == "greedy_equivalence")
    assert greedy["metrics"]["real_mismatches"] == 2 and "not a near-tie" in greedy["failures"][0]


def test_validate_endpoint_compares_text_where_the_endpoint_gives_no_token_ids(served, tmp_path, capsys):
    url, build = served
    proxy = _Proxy(url, "text-only")
    try:
        code, out, err = validate(capsys, "--endpoint", proxy.url, "--model", MODEL, "--reference", build, "--gate",
                                  _gate(tmp_path, latency={"enabled": False}), "--report-dir", tmp_path / "r", "--quiet")
    finally:
        proxy.close()
    assert code == 0, out + err
    assert "PASSED  greedy_equivalence: 2/2 prompts identical (text)" in out
    assert "SKIPPED distribution_equivalence: the endpoint does not return the token ids it sampled" in out


def test_validate_endpoint_fails_an_slo_it_cannot_meet(served, tmp_path, capsys):
    url, build = served
    gate = _gate(tmp_path, distribution={"enabled": False}, latency={"ttft_ms_p50_max": 0.001, "tokens_per_s_min": 1e9})
    code, out, err = validate(capsys, "--endpoint", url, "--model", MODEL, "--reference", build, "--gate", gate,
                              "--report-dir", tmp_path / "r", "--quiet")
    assert code == 1, out + err
    assert "gate failed: latency_slo" in one_line_error(err)
    latency = next(c for c in json.loads((tmp_path / "r" / "report.json").read_text())["checks"] if c["name"] == "latency_slo")
    assert len(latency["failures"]) == 2 and latency["failures"][0].startswith("ttft_ms_p50 = ")
    assert any("speedup_min" in line for line in json.loads((tmp_path / "r" / "report.json").read_text())["not_checked"])


@pytest.mark.parametrize("args, needle", [
    (["--model", MODEL], "--endpoint needs a reference"),
    (["--reference-endpoint", "http://127.0.0.1:1/v1"], "also pass --model"),
    (["--model", MODEL, "--reference-endpoint", "http://127.0.0.1:1/v1", "--reference-extra", "{"], "--reference-extra is not JSON"),
    (["--model", MODEL, "--reference-endpoint", "http://127.0.0.1:1/v1", "--endpoint-extra", "[1]"],
     "--endpoint-extra must be a JSON object"),
    (["--model", MODEL, "--reference", "engines/x", "--reference-extra", "{}"], "--reference-extra goes with --reference-endpoint"),
])
def test_endpoint_usage_errors_are_one_line(capsys, args, needle):
    code, out, err = validate(capsys, "--endpoint", "http://127.0.0.1:1/v1", *args)
    assert code == 2 and needle in one_line_error(err)


def test_an_unreachable_endpoint_is_one_clear_error(tmp_path, capsys):
    port = free_port()
    code, out, err = validate(capsys, "--endpoint", f"http://127.0.0.1:{port}/v1", "--model", MODEL, "--reference-endpoint",
                              f"http://127.0.0.1:{port}/v1", "--report-dir", tmp_path / "r", "--quiet")
    assert code == 2 and f"no answer from http://127.0.0.1:{port}/v1" in one_line_error(err)
    assert not (tmp_path / "r").exists()  # nothing half-written


def test_a_connection_the_server_closes_is_announced(served):
    """A refusal and a stream close their connection afterwards; each says so (`Connection: close`), so a client
    that keeps connections opens a new one for its next request instead of sending it into a closing socket
    (seen under load: "Server disconnected without sending a response"). A keep-alive answer does not say it."""
    import http.client
    from urllib.parse import urlparse

    url, _ = served
    where = urlparse(url)

    def ask(body: dict) -> tuple[int, str | None]:
        connection = http.client.HTTPConnection(where.hostname, where.port, timeout=300)
        try:
            connection.request("POST", where.path + "/completions", body=json.dumps(body),
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            return response.status, response.getheader("Connection")
        finally:
            connection.close()

    assert ask({"model": MODEL, "prompt": "x", "max_tokens": -1}) == (400, "close")
    assert ask({"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}) == (200, "close")
    status, header = ask({"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert status == 200 and header != "close"
