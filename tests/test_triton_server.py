"""The served model through a real tritonserver on free loopback ports, over gRPC.

One module-scoped server serves a relocated repository with three models built from the tiny pair:
`ensemble` (an unrelated random draft: mostly rejections and rollbacks; 2 instances), `self_draft`
(draft = target: every draft accepted, so each streamed response carries several tokens) and
`target_alone` (no draft, as `build` deploys when every candidate draft was slower than the target alone).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest

import specpipe
from specpipe.builder import build
from specpipe.builder.config import BuildConfig
from specpipe.contract.generation import GenerationConfig, SamplingConfig
from specpipe.deployment import load_deployment
from specpipe.errors import ServerError
from specpipe.triton import ServerConfig, TritonServer, write_repository
from specpipe.triton.client import remote_generate
from specpipe.triton.stubs import SHM_DIR, find_stubs, repository_prefix

PROJECT_ROOT = Path(specpipe.__file__).resolve().parents[1]
PROMPTS = ["def add(a, b):", "Héllo wörld — naïve café, 東京 🙂", "The quick brown fox", "import numpy as np\n"]


def _ports() -> ServerConfig:
    return ServerConfig.on_free_ports(ready_timeout_s=180)


@pytest.fixture(scope="module")
def builds(tiny_target, tiny_draft, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("triton_engines")
    make = lambda name, draft: build(  # noqa: E731
        BuildConfig(target=str(tiny_target), draft=str(draft), name=name, engines_dir=root, repo_dir=None)
    )
    return {"ensemble": make("pair", tiny_draft), "self_draft": make("self", tiny_target), "target_alone": make("alone", "none")}


@pytest.fixture(scope="module")
def repo(builds, tmp_path_factory) -> Path:
    """Written in one place, then moved: the server only ever sees the moved copy (relocatable)."""
    written = tmp_path_factory.mktemp("written") / "triton_repo"
    write_repository(builds["ensemble"], written, model_name="ensemble", instance_count=2)
    write_repository(builds["self_draft"], written, model_name="self_draft", instance_count=1)
    write_repository(builds["target_alone"], written, model_name="target_alone", instance_count=1)
    write_repository(builds["target_alone"], written, model_name="target_alone_every_4", instance_count=1, stream_interval=4)
    moved = tmp_path_factory.mktemp("moved") / "elsewhere"
    shutil.move(str(written), str(moved))
    assert not written.exists()
    return moved


@pytest.fixture(scope="module")
def server(repo):
    with TritonServer(repo, _ports()) as running:
        yield running


@pytest.fixture(scope="module")
def local(builds):
    """The same engines in-process, through the same continuous-batching scheduler the served model runs:
    what the server must reproduce (one request at a time here, so K is chosen alike)."""
    deployments = {name: load_deployment(path, threads=1, batching=True) for name, path in builds.items()}

    def generate(model: str, prompt: str, cfg: GenerationConfig, chat: bool = False):
        deployment = deployments[model]
        return deployment.generator.generate(prompt, deployment.generation_config(**cfg.model_dump()), chat=chat)

    return generate


CONFIGS = {
    "adaptive": GenerationConfig(max_new_tokens=24),
    "fixed_k3": GenerationConfig(max_new_tokens=24, num_draft_tokens=3, draft_length="fixed"),
    "target_only": GenerationConfig(max_new_tokens=24, speculative=False),
    "sampled_seeded": GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(temperature=0.8, top_p=0.9), seed=11),
}


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not_streamed"])
@pytest.mark.parametrize("model", ["ensemble", "self_draft", "target_alone"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_served_output_equals_in_process_output(server, local, model, config, stream):
    cfg = CONFIGS[config]
    for prompt in PROMPTS:
        expected = local(model, prompt, cfg)
        generation = remote_generate(server.url, prompt, cfg, stream=stream, model_name=model)
        deltas = list(generation)
        result = generation.result
        assert result["token_ids"] == expected.token_ids, prompt
        assert "".join(deltas) == result["text"] == expected.text, prompt
        assert (result["drafted"], result["accepted"]) == (expected.stats.drafted, expected.stats.accepted)
        assert result["finish_reason"] == expected.finish_reason
        if stream:
            assert sum(result["chunk_tokens"]) == len(expected.token_ids)
            assert len(result["chunk_tokens"]) == expected.stats.steps  # one response per speculative step
        else:
            assert result["chunk_tokens"] == [len(expected.token_ids)]
        if model == "self_draft" and cfg.speculative and result["drafted"]:
            # (adaptive K may not draft at all: a draft as costly as the target never pays, batching.py)
            assert result["acceptance_rate"] == 1.0
            if stream:
                assert max(result["chunk_tokens"]) > 1  # several accepted tokens stream in one response


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not_streamed"])
def test_a_model_without_a_draft_answers_as_the_target_alone(server, local, stream):
    cfg = CONFIGS["adaptive"]  # speculative requested: there is nothing to draft with
    for prompt in PROMPTS[:2]:
        generation = remote_generate(server.url, prompt, cfg, stream=stream, model_name="target_alone")
        "".join(generation)
        alone = local("ensemble", prompt, CONFIGS["target_only"])  # the same target engine, decoding alone
        assert generation.result["token_ids"] == alone.token_ids and generation.result["drafted"] == 0


def test_a_stream_interval_gathers_tokens_into_fewer_responses_and_changes_no_token(server, local):
    """stream_interval 4 on a target alone (one token a step): the first token in a response of its own, then
    four a response, the rest on the final one; the same tokens and text as one response a token."""
    cfg = CONFIGS["target_only"]
    for prompt in PROMPTS[:2]:
        expected = local("target_alone", prompt, cfg)
        generation = remote_generate(server.url, prompt, cfg, stream=True, model_name="target_alone_every_4")
        deltas = list(generation)
        result = generation.result
        assert result["token_ids"] == expected.token_ids and "".join(deltas) == expected.text == result["text"]
        n = len(expected.token_ids)
        assert n > 5
        assert result["chunk_tokens"] == [1] + [4] * ((n - 1) // 4) + ([(n - 1) % 4] if (n - 1) % 4 else [])


def test_chat_template_is_applied_server_side(server, local):
    cfg = CONFIGS["adaptive"]
    generation = remote_generate(server.url, "hello", cfg, stream=True, chat=True)
    "".join(generation)
    expected = local("ensemble", "hello", cfg, chat=True)
    assert generation.result["token_ids"] == expected.token_ids
    assert generation.result["prompt_len"] == expected.prompt_len > len("hello")


@pytest.mark.timing
def test_concurrent_streaming_clients_all_complete_correctly_and_run_together(server, local):
    """8 clients x 5 streamed requests on a 2-instance model: all correct, and more requests decoding at once than
    there are instances (continuous batching: each instance decodes its requests together instead of queueing
    them; a queueing server never has more than 2). The clients send each round together (a barrier); how many
    overlap beyond that depends on the machine's load, so the test asserts the rule, not "all 8"."""
    cfgs = [GenerationConfig(max_new_tokens=n) for n in (8, 16, 24, 32, 40)]
    expected = {(p, c.max_new_tokens): local("ensemble", p, c).token_ids for p in PROMPTS for c in cfgs}
    results, errors = [], []
    rounds = threading.Barrier(8)

    def client(index: int) -> None:
        try:
            for j, cfg in enumerate(cfgs):
                rounds.wait(timeout=300)
                prompt = PROMPTS[(index + j) % len(PROMPTS)]
                generation = remote_generate(server.url, prompt, cfg, stream=True)
                text = "".join(generation)
                results.append((prompt, cfg.max_new_tokens, text, generation.result))
        except Exception as exc:  # surfaced below with the client's number
            errors.append(f"client {index}: {exc!r}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert len(results) == 40
    for prompt, max_tokens, text, result in results:
        assert result["token_ids"] == expected[(prompt, max_tokens)]
        assert text == result["text"]

    # Server-side intervals (TensorRT-LLM's perf outputs, arrival -> last token). The model stamps the arrival when
    # its instance takes the request: on a server that queued them, a request waiting for its instance would arrive
    # later, so at most 2 would overlap. An end sorts before a start at the same nanosecond.
    events = sorted([(r["perf"]["arrival_time_ns"], 1) for *_, r in results]
                    + [(r["perf"]["last_token_time_ns"], -1) for *_, r in results])
    busy, most = 0, 0
    for _, change in events:
        busy += change
        most = max(most, busy)
    print(f"at most {most} of 8 requests decoding at once")
    assert most > 2, most  # 2 = the model's instances: more means requests were batched, not queued


def _tensorrt_llm_client(url: str, prompt: str, *, streaming: bool, num_draft_tokens: int, seed: int):
    """Written only from tensorrtllm_backend's inflight_batcher_llm/client/end_to_end_grpc_client.py:
    its tensor names, dtypes, [1, 1] shapes and requested outputs. No specpipe imports."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = {
        "text_input": np.array([[prompt]]).astype(object),
        "max_tokens": np.ones_like([[prompt]]).astype(np.int32) * 20,
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[1.0]], dtype=np.float32),
        "num_draft_tokens": np.array([[num_draft_tokens]], dtype=np.int32),
        "seed": np.array([[seed]], dtype=np.uint64),
        "exclude_input_in_output": np.array([[False]], dtype=bool),
        "return_perf_metrics": np.array([[True]], dtype=bool),
        "stop_words": np.array([["never-appears"]], dtype=object),
    }
    tensors = []
    for name, value in inputs.items():
        tensor = grpcclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    outputs = [grpcclient.InferRequestedOutput(name) for name in (
        "text_output", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
        "kv_cache_alloc_new_blocks", "arrival_time_ns", "first_token_time_ns", "last_token_time_ns")]
    completed = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: completed.put(error or result))
    client.async_stream_infer("ensemble", tensors, outputs=outputs, request_id="1")
    client.stop_stream()  # waits until the server closes the stream
    client.close()
    text, last = "", None
    while not completed.empty():
        result = completed.get()
        assert not isinstance(result, Exception), result
        output = result.as_numpy("text_output")[0].decode("utf-8")
        text = text + output if streaming else output
        last = result
    return text, {name: last.as_numpy(name)[0][0] for name in (
        "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "arrival_time_ns", "last_token_time_ns")}


@pytest.mark.parametrize("streaming", [True, False], ids=["streamed", "not_streamed"])
def test_a_tensorrt_llm_client_works_unchanged(server, local, streaming):
    prompt = PROMPTS[0]
    text, perf = _tensorrt_llm_client(server.url, prompt, streaming=streaming, num_draft_tokens=3, seed=5)
    cfg = GenerationConfig(max_new_tokens=20, num_draft_tokens=3, draft_length="fixed",
                           sampling=SamplingConfig(temperature=1.0), seed=5, stop=["never-appears"])
    expected = local("ensemble", prompt, cfg)
    # TensorRT-LLM semantics: exclude_input_in_output false returns prompt + completion when not streaming.
    assert text == (expected.text if streaming else prompt + expected.text)
    assert perf["total_draft_tokens"] == expected.stats.drafted > 0
    assert perf["total_accepted_draft_tokens"] == expected.stats.accepted
    assert perf["acceptance_rate"] == pytest.approx(expected.stats.acceptance_rate)
    assert perf["last_token_time_ns"] >= perf["arrival_time_ns"] > 0


def _raw_request(url: str, tensors: dict[str, np.ndarray]):
    """Send tensors as they are; return (error message or None, concatenated text)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, value in tensors.items():
        tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    completed = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: completed.put((result, error)))
    client.async_stream_infer("ensemble", inputs)
    client.stop_stream()
    client.close()
    text, errors = "", []
    while not completed.empty():
        result, error = completed.get()
        if error is not None:
            errors.append(error.message())
        else:
            text += result.as_numpy("text_output").reshape(-1)[0].decode()
    return ("; ".join(errors) or None), text


GOOD = {
    "text_input": np.array([[b"def add(a, b):"]], dtype=object),
    "max_tokens": np.array([[12]], dtype=np.int32),
    "stream": np.array([[True]], dtype=bool),
}
BAD_REQUESTS = {
    "missing text_input": ({"text_input": None}, "text_input"),
    "empty prompt": ({"text_input": np.array([[b""]], dtype=object)}, "text_input is empty"),
    "max_tokens 0": ({"max_tokens": np.array([[0]], np.int32)}, "max_tokens must be >= 1, got 0"),
    "max_tokens negative": ({"max_tokens": np.array([[-3]], np.int32)}, "max_tokens must be >= 1, got -3"),
    "max_tokens above the engine": ({"max_tokens": np.array([[100_000]], np.int32)}, "exceeds the engine's max_seq_len"),
    "temperature negative": ({"temperature": np.array([[-0.5]], np.float32)}, "temperature must be >= 0"),
    "max_tokens as FP32": ({"max_tokens": np.array([[12.0]], np.float32)}, "max_tokens"),
    "stop_words as INT32": ({"stop_words": np.array([[1, 2]], np.int32)}, "stop_words"),
    "beam search": ({"beam_width": np.array([[4]], np.int32)}, "beam_width must be 1"),
    "K above the build": ({"num_draft_tokens": np.array([[99]], np.int32)}, "max_draft_len"),
    "end_id outside the vocabulary": ({"end_id": np.array([[10**6]], np.int32)}, "end_id 1000000 is outside"),
    "batch of two": ({"text_input": np.array([[b"a"], [b"b"]], dtype=object)}, "batch"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_an_error_and_the_server_keeps_serving(server, case):
    changes, message = BAD_REQUESTS[case]
    tensors = {**GOOD, **changes}
    tensors = {name: value for name, value in tensors.items() if value is not None}
    error, text = _raw_request(server.url, tensors)
    assert error is not None and message in error, error
    assert text == ""
    error, text = _raw_request(server.url, GOOD)
    assert error is None and text


def test_metrics_port_reports_triton_and_acceptance_counters(server):
    import urllib.request

    remote_generate(server.url, PROMPTS[0], CONFIGS["fixed_k3"], stream=False).__iter__().__next__()
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    labels = '{model="ensemble",version="1"}'
    assert values['nv_inference_request_success' + labels] > 0
    assert values["specpipe_requests_total" + labels] > 0
    assert values["specpipe_draft_tokens_total" + labels] >= values["specpipe_accepted_draft_tokens_total" + labels] > 0
    assert values["specpipe_generated_tokens_total" + labels] > 0


def test_generate_cli_through_the_server(server, local):
    from click.testing import CliRunner

    from specpipe.cli import cli

    out = CliRunner().invoke(cli, ["generate", "--url", server.url, "--prompt", PROMPTS[1], "--max-tokens", "16",
                                   "--stream", "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.output.strip().splitlines()[-1])
    assert result["token_ids"] == local("ensemble", PROMPTS[1], GenerationConfig(max_new_tokens=16)).token_ids


def test_unreachable_url_is_one_clear_error():
    with pytest.raises(ServerError, match="cannot reach a Triton server at 127.0.0.1:1"):
        list(remote_generate("127.0.0.1:1", "hi", GenerationConfig(max_new_tokens=2), stream=True))


# -- `specpipe serve` as a user runs it --------------------------------------------------------------

def _serve(repo: Path, cfg: ServerConfig) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specpipe", "serve", str(repo), "--grpc-port", str(cfg.grpc_port),
           "--http-port", str(cfg.http_port), "--metrics-port", str(cfg.metrics_port), "--timeout", "180"]
    return subprocess.Popen(cmd, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})


def test_serve_exits_nonzero_with_the_reason_when_an_engine_is_corrupt(builds, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(builds["self_draft"], broken)  # real copies: the fixture's engines stay intact
    (broken / "target" / "model.onnx").write_bytes(b"not an onnx graph")
    write_repository(broken, tmp_path / "repo")
    process = _serve(tmp_path / "repo", _ports())
    _, stderr = process.communicate(timeout=240)
    assert process.returncode != 0
    first = stderr.strip().splitlines()[0]
    assert first.startswith("error: tritonserver exited") or "error:" in stderr, stderr
    assert "model 'ensemble' failed to load" in stderr and "cannot load" in stderr, stderr
    assert "last server log lines" in stderr
    assert "Traceback" not in stderr.split("last server log lines")[0]


def _until_ready(process: subprocess.Popen) -> tuple[list[str], threading.Thread]:
    """Wait for `specpipe serve`'s ready line; returns its stderr lines (still filling) and their reader."""
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stderr.readline, "")), daemon=True)
    reader.start()
    deadline = time.time() + 180
    while not any("ready in" in line for line in lines):
        assert process.poll() is None, "".join(lines)
        assert time.time() < deadline, "".join(lines)
        time.sleep(0.1)
    return lines, reader


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_serve_answers_then_stops_cleanly_on_a_signal(builds, tmp_path, signum):
    write_repository(builds["self_draft"], tmp_path / "repo")
    cfg = _ports()
    process = _serve(tmp_path / "repo", cfg)
    lines, reader = _until_ready(process)
    generation = remote_generate(f"127.0.0.1:{cfg.grpc_port}", "def", GenerationConfig(max_new_tokens=4), stream=True)
    assert "".join(generation) == generation.result["text"] and generation.result["num_generated"] == 4
    process.send_signal(signum)
    assert process.wait(timeout=60) == 0, "".join(lines)
    reader.join(timeout=10)
    assert any(line.startswith("stopped") for line in lines), "".join(lines)
    with pytest.raises(ServerError, match="cannot reach"):
        list(remote_generate(f"127.0.0.1:{cfg.grpc_port}", "def", GenerationConfig(max_new_tokens=2), stream=True))


# -- a killed server leaves nothing behind ---------------------------------------------------------------

# Still in flight when the server is killed, milliseconds after its first response: ~400 one-token steps
# (the unrelated draft of `ensemble` is mostly rejected) take most of a second on this tiny pair.
IN_FLIGHT = GenerationConfig(max_new_tokens=400, stop_on_eos=False)


def _stubs_of(repo: Path):
    return [stub for stub in find_stubs() if stub.model_py.resolve().is_relative_to(repo.resolve())]


def _regions_of(repo: Path) -> list[str]:
    return [path.name for path in SHM_DIR.glob(repository_prefix(repo) + "*")]


def _stream_in_background(url: str, cfg: GenerationConfig, *, wait: bool = True,
                          on_first: Optional[Callable[[], None]] = None) -> dict:
    """A streamed request on a thread: `first` is set at its first response (or its end), after `on_first` ran on
    the request's own thread; then `error` and `failed_at` (time.monotonic()) once it fails, or `generated` (the
    tokens the server says it made) once it completes; `ended_at` and `done` once it ends either way. `wait`: return only after its first response."""
    state = {"first": threading.Event(), "error": None, "failed_at": None, "ended_at": None, "crash": None,
             "generated": None, "done": threading.Event()}

    def run() -> None:
        try:
            generation = remote_generate(url, PROMPTS[0], cfg, stream=True, timeout_s=30)
            for _ in generation:
                if on_first is not None and not state["first"].is_set():
                    on_first()
                state["first"].set()
            state["generated"] = generation.result["num_generated"]
        except ServerError as err:
            state["error"], state["failed_at"] = str(err), time.monotonic()
        except BaseException as exc:  # anything else is a client defect: recorded for the assertion, not lost
            state["crash"] = f"{type(exc).__name__}: {exc}"
        state["ended_at"] = time.monotonic()
        state["first"].set()
        state["done"].set()

    threading.Thread(target=run, daemon=True).start()
    if wait:
        _assert_started(state)
    return state


def _assert_started(state: dict) -> None:
    assert state["first"].wait(60) and state["error"] is None and state["crash"] is None, state


# A bound on waits for things that must happen (a client's error, a stub's exit), not a speed target: on a
# loaded machine they take longer, and a planted bug (nothing happens) still fails at the deadline.
DEADLINE_S = 60


def _wait_until(condition, timeout_s: float, since: float) -> float:
    """Seconds from `since` (a time.monotonic()) until condition() held; fails after timeout_s."""
    while not condition():
        assert time.monotonic() - since < timeout_s, f"not within {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - since


@pytest.mark.timing
def test_serve_killed_with_a_request_in_flight_leaves_nothing_and_the_next_server_answers_the_same(
        builds, local, tmp_path):
    repo = tmp_path / "repo"
    write_repository(builds["ensemble"], repo)
    cfg = _ports()
    process = _serve(repo, cfg)
    try:
        lines, reader = _until_ready(process)
        [stub] = _stubs_of(repo)
        assert _regions_of(repo) == [stub.shm_region]
        # In flight at the kill: the client's own thread stops the stub as it reads the first response, so the
        # stream can end first only if that thread is starved for the whole rest of it (~0.4 s of 400 tokens
        # here), not across a hand-off to this thread as before (on a fast CPU under a hog all 400 tokens once
        # came out between the first response and the kill: no error to see). The stub continues right after,
        # as a busy stub would, to find its server gone.
        request = _stream_in_background(f"127.0.0.1:{cfg.grpc_port}", IN_FLIGHT,
                                        on_first=lambda: os.kill(stub.pid, signal.SIGSTOP))
        killed = time.monotonic()
        os.kill(stub.server_pid, signal.SIGKILL)
        os.kill(stub.pid, signal.SIGCONT)

        # How soon each thing happens depends on the machine's load: printed below, bounded only by deadlines.
        assert request["done"].wait(DEADLINE_S), f"the client got no error within {DEADLINE_S} s"
        assert request["error"]
        clean_s = _wait_until(lambda: not _stubs_of(repo) and not _regions_of(repo), DEADLINE_S, since=killed)
        assert process.wait(timeout=30) == 2
        reader.join(timeout=10)
        error = lines[-1]
        assert error.startswith("error: tritonserver was killed by SIGKILL"), "".join(lines)
        assert "Traceback" not in "".join(lines)
        print(f"kill -9 -> client error {request['failed_at'] - killed:.2f} s, no stub, no region: {clean_s:.2f} s; "
              f"{stub.rss_bytes / 2**20:.0f} MB of stub returned")
    finally:
        process.kill()
        for stub in _stubs_of(repo):
            os.kill(stub.pid, signal.SIGKILL)

    with TritonServer(repo, _ports()) as server:
        assert not server.leftovers
        generation = remote_generate(server.url, PROMPTS[0], IN_FLIGHT, stream=True)
        "".join(generation)
    assert generation.result["token_ids"] == local("ensemble", PROMPTS[0], IN_FLIGHT).token_ids
    assert not _stubs_of(repo) and not _regions_of(repo)


@pytest.mark.timing
def test_stubs_exit_by_themselves_and_the_next_server_ends_one_that_could_not(builds, tmp_path):
    """No one cleans up after the killed server here: one busy stub must exit by itself (its watchdog); a
    stopped one (a stub that cannot, like the stub of the report that ran on for 34 minutes) is ended by the
    next server of the repository before it starts."""
    repo = tmp_path / "repo"
    write_repository(builds["ensemble"], repo, instance_count=2)
    server = TritonServer(repo, _ports())
    with server:
        stubs = _stubs_of(repo)
        assert len(stubs) == 2 and sorted(_regions_of(repo)) == sorted(stub.shm_region for stub in stubs)
        # One in flight on each stub, started together: a request started after another's first response could
        # find it finished (CI, loaded: ~400 tokens of this tiny pair ran out before the second one began).
        requests = [_stream_in_background(server.url, IN_FLIGHT, wait=False) for _ in stubs]
        for request in requests:
            _assert_started(request)
        stuck, free = stubs
        os.kill(stuck.pid, signal.SIGSTOP)
        try:
            killed = time.monotonic()
            server.process.kill()
            server.process.wait()
            # No client hangs; every request still running when the server died fails with a clear error. One
            # that came to its end (all its tokens) before the kill is no evidence either way; the client's own clock
            # cannot tell (CI under a hog: a stream complete before the kill, its thread recorded the end after
            # it). A request with neither error nor all its tokens is the defect: a cut stream that looks done.
            for request in requests:
                assert request["done"].wait(DEADLINE_S), f"a client got no error within {DEADLINE_S} s: {request}"
                assert request["crash"] is None, request
                assert request["error"] or request["generated"] == IN_FLIGHT.max_new_tokens, request
            assert any(request["error"] for request in requests), requests
            # Our watchdog, or the stub's own check once the server is reaped (that one can hang with a request
            # in flight, and may leave the region: the next server removes it then).
            exit_s = _wait_until(lambda: free.pid not in [stub.pid for stub in _stubs_of(repo)], DEADLINE_S, since=killed)
            assert [stub.pid for stub in _stubs_of(repo)] == [stuck.pid]
            print(f"busy stub exited by itself {exit_s:.2f} s after kill -9")

            with TritonServer(repo, _ports()) as again:
                assert again.leftovers.stubs == 1 and again.leftovers.rss_bytes > 0 and again.leftovers.regions >= 1
                assert stuck.pid not in [stub.pid for stub in _stubs_of(repo)] and len(_stubs_of(repo)) == 2
                assert not {stuck.shm_region, free.shm_region} & set(_regions_of(repo))
        finally:
            if stuck.pid in [stub.pid for stub in _stubs_of(repo)]:
                os.kill(stuck.pid, signal.SIGKILL)
    assert not _stubs_of(repo) and not _regions_of(repo)
