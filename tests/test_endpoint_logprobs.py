"""`validate --endpoint` where the endpoint gives no token ids but log-probabilities (llama.cpp's server, OpenAI's
legacy completions): the distribution check tests the sampled tokens against the reference endpoint's top
log-probabilities. A fake server with a known distribution passes; the same server with a planted wrong
sampler fails."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from specpipe.triton import free_port
from tests.test_gate import _toml, one_line_error, small_gate, validate, write_toml

pytestmark = pytest.mark.timing
TOKENS = ["a", "b", "c", "d", "e", "f"]
P_FIRST = np.array([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
P_SECOND = np.array([0.05, 0.4, 0.3, 0.1, 0.1, 0.05])  # after the greedy first token "a"


class FakeServer:
    """/v1/completions with two positions of known p; `planted`: sampled tokens shifted by one rank."""

    def __init__(self, planted: bool = False):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                status, answer = (400, {"error": {"message": "no streaming here"}}) if body.get("stream") else (200, fake.answer(body))
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.planted = planted
        self.bodies: list[dict] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def answer(self, body: dict) -> dict:
        temperature, top_k = body.get("temperature", 1.0), body.get("top_k", 0)
        rng = np.random.default_rng(body.get("seed"))
        tokens = []
        for p in (P_FIRST, P_SECOND)[: body.get("max_tokens", 16)]:
            if temperature == 0:
                tokens.append(int(np.argmax(p)))
                continue
            shaped = p ** (1 / temperature)
            if top_k:
                shaped = np.where(shaped >= np.sort(shaped)[-top_k], shaped, 0.0)
            rank = int(rng.choice(len(p), p=shaped / shaped.sum()))
            tokens.append((rank + 1) % 5 if self.planted else rank)
        logprobs = None
        if body.get("logprobs"):
            n = min(int(body["logprobs"]), len(TOKENS))
            tops = [{TOKENS[i]: float(np.log(p[i])) for i in np.argsort(-p)[:n]} for p in (P_FIRST, P_SECOND)[: len(tokens)]]
            logprobs = {"tokens": [TOKENS[t] for t in tokens], "top_logprobs": tops}
        text = "".join(TOKENS[t] for t in tokens)
        return {"choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": len(tokens), "total_tokens": 1 + len(tokens)}}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


GATE = dict(latency={"enabled": False}, robustness={"enabled": False}, greedy={"max_new_tokens": 2})


@pytest.mark.parametrize("planted", [False, True], ids=["faithful", "planted_wrong_sampler"])
def test_distribution_through_log_probabilities(tmp_path, capsys, planted):
    reference, endpoint = FakeServer(), FakeServer(planted=planted)
    try:
        code, out, err = validate(capsys, "--endpoint", endpoint.url, "--model", "m", "--reference-endpoint", reference.url,
                                  "--endpoint-extra", '{"min_p": 0}', "--gate", write_toml(tmp_path / "g.toml", _toml(small_gate(**GATE))),
                                  "--report-dir", tmp_path / "r", "--quiet")
    finally:
        reference.close()
        endpoint.close()
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    dist = next(c for c in report["checks"] if c["name"] == "distribution_equivalence")
    assert any("tested on the reference endpoint's log-probabilities" in line for line in report["not_checked"])
    assert dist["metrics"]["samples_per_case"] == [300, 300]
    assert all(body.get("min_p") == 0 for server in (reference, endpoint) for body in server.bodies)  # --endpoint-extra: both
    if not planted:
        assert code == 0 and dist["status"] == "passed", out + err
        assert all(t["impossible_tokens"] == 0 for t in dist["metrics"]["tests"])
    else:
        assert code == 1 and dist["status"] == "failed", out + err
        assert "gate failed: distribution_equivalence" in one_line_error(err)
