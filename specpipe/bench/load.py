"""Load on a real Triton server: closed-loop streaming users at several concurrencies, and what each level saw.

    run_loadtest(LoadConfig(), target=Path("triton_repo"))  -> a run (dict); report = {"schema", "runs": [run]}

Closed loop: at concurrency C, C users each hold one gRPC connection and send their next request the moment the
previous one has finished, until the level's `requests` are done. Warm-up requests go first and are not measured.

Conventions, per level:
- TTFT: request sent -> first response carrying tokens, at the client (queueing in the server included).
- ITL (inter-token latency): a later response carrying n tokens, arriving gap ms after the previous response of
  the same request, gives n samples of gap / n ms. Percentiles are over every token of the level, as a reader
  of the streams sees them. (Speculation delivers several tokens per response: 40 ms for 4 tokens is 4 x 10 ms.)
- tokens_per_s (aggregate): all tokens of the level / its wall time (first request sent -> last one done).
- request_tokens_per_s: a request's tokens / its latency (sent -> last response, queueing included); p50.
- errors: requests the server refused, or that failed or timed out on the way, each with its message. They count
  in `requests` and `errors` and in no latency statistic.
- rss_mb: tritonserver and its Python-backend stubs (its child processes) together, sampled during the level;
  growth_pct = end / start - 1. Pages the processes share (the stubs' shared memory) are counted in each.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional
from urllib.parse import urlsplit

import numpy as np

from specpipe.config import LoadConfig
from specpipe.errors import ServerError, UsageError

SCHEMA = "specpipe.loadtest/1"
RequestMaker = Callable[[int], dict]  # request index -> input tensors (name -> numpy array)


# ---- one level ------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """One request as its user saw it. Times in ms since it was sent; `sent_ms` since the level started."""

    index: int
    stream: int
    sent_ms: float
    total_ms: Optional[float] = None
    chunk_ms: list[float] = field(default_factory=list)  # arrival of each response that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens each of those responses carried
    error: Optional[str] = None
    result: dict = field(default_factory=dict, repr=False)  # the client's whole result (server statistics)

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft_ms(self) -> Optional[float]:
        return self.chunk_ms[0] if self.chunk_ms else None

    def as_dict(self) -> dict:
        return {"index": self.index, "stream": self.stream, "sent_ms": self.sent_ms, "ttft_ms": self.ttft_ms,
                "total_ms": self.total_ms, "tokens": self.tokens, "responses": len(self.chunk_ms), "error": self.error}


@dataclass
class LevelRun:
    concurrency: int
    records: list[RequestRecord]
    wall_s: float
    rss_bytes: list[int] = field(default_factory=list)  # server memory samples in time order; [] = not measurable


def run_level(url: str, model_name: str, make_request: RequestMaker, concurrency: int, requests: int, *,
              timeout_s: float = 600.0, server_pid: Optional[int] = None, rss_interval_s: float = 0.5,
              on_done: Optional[Callable[[RequestRecord], None]] = None) -> LevelRun:
    """`requests` requests (make_request(0), (1), ...) sent by `concurrency` closed-loop streaming users."""
    import tritonclient.grpc as grpcclient

    from specpipe.triton.client import RemoteGeneration

    next_index, lock = iter(range(requests)), threading.Lock()
    records: list[RequestRecord] = []

    def user(stream: int) -> None:
        client = grpcclient.InferenceServerClient(url)
        try:
            while True:
                with lock:
                    index = next(next_index, None)
                if index is None:
                    return
                record = RequestRecord(index, stream, (time.perf_counter() - started) * 1e3)
                try:
                    generation = RemoteGeneration(url, make_request(index), model_name=model_name,
                                                  timeout_s=timeout_s, client=client)
                    for _ in generation:
                        pass
                    result = generation.result
                    record.total_ms, record.result = result["total_ms"], result
                    record.chunk_ms, record.chunk_tokens = list(result["chunk_ms"]), list(result["chunk_tokens"])
                except Exception as exc:  # noqa: BLE001 -- a load test counts failures and goes on
                    record.error = _one_line(exc)
                with lock:
                    records.append(record)
                if on_done is not None:
                    on_done(record)
        finally:
            client.close()

    with _memory_sampler(server_pid, rss_interval_s) as rss:
        users = [threading.Thread(target=user, args=(n,), name=f"loadtest-user-{n}", daemon=True)
                 for n in range(min(concurrency, requests))]
        started = time.perf_counter()
        for thread in users:
            thread.start()
        for thread in users:
            thread.join()
        wall_s = time.perf_counter() - started
    return LevelRun(concurrency, sorted(records, key=lambda r: r.index), wall_s, rss)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


# ---- statistics -----------------------------------------------------------------------------------


def itl_samples(chunk_ms: list[float], chunk_tokens: list[int]) -> list[float]:
    """Per-token inter-token latencies of one request (see the module docstring).

    chunk_ms [100, 140, 150], chunk_tokens [1, 4, 1] -> [10, 10, 10, 10, 10]: 4 tokens 40 ms after the first
    response, then 1 token 10 ms later. The first response's tokens have no predecessor: that is TTFT."""
    samples: list[float] = []
    for previous_ms, arrived_ms, tokens in zip(chunk_ms, chunk_ms[1:], chunk_tokens[1:]):
        samples += [(arrived_ms - previous_ms) / tokens] * tokens
    return samples


def summarize_level(level: LevelRun) -> dict:
    """A level's row: the numbers the module docstring defines; None where there is nothing to measure."""
    done = [r for r in level.records if r.error is None]
    failed = [r for r in level.records if r.error is not None]
    tokens = sum(r.tokens for r in done)
    ttft = [r.ttft_ms for r in done if r.ttft_ms is not None]
    itl = [sample for r in done for sample in itl_samples(r.chunk_ms, r.chunk_tokens)]
    request_rates = [r.tokens / (r.total_ms / 1e3) for r in done if r.total_ms]
    messages: dict[str, int] = {}
    for r in failed:
        messages[r.error] = messages.get(r.error, 0) + 1
    return {
        "concurrency": level.concurrency,
        "requests": len(level.records),
        "errors": len(failed),
        "error_messages": messages,  # message -> how many requests got it
        "wall_s": level.wall_s,
        "output_tokens": tokens,
        "tokens_per_s": tokens / level.wall_s if level.wall_s > 0 else None,
        "request_tokens_per_s_p50": percentile(request_rates, 50),
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p95": percentile(ttft, 95),
        "itl_ms_p50": percentile(itl, 50),
        "itl_ms_p95": percentile(itl, 95),
        "rss_mb": rss_summary(level.rss_bytes),
    }


def percentile(values: list[float], q: float) -> Optional[float]:
    """numpy's linear interpolation (genai-perf's too); None when there are no values (JSON has no NaN)."""
    return float(np.percentile(values, q)) if values else None


def rss_summary(samples: list[int]) -> Optional[dict]:
    if not samples:
        return None
    start, end = samples[0], samples[-1]
    return {"start": start / 2**20, "end": end / 2**20, "max": max(samples) / 2**20,
            "growth_pct": 100.0 * (end / start - 1.0) if start else None, "samples": len(samples)}


# ---- the server's memory --------------------------------------------------------------------------


def process_tree_rss(pid: int, proc: Path = Path("/proc")) -> Optional[int]:
    """Resident bytes of `pid` and all its descendants (Linux /proc); None when pid is gone or /proc is absent."""
    parents: dict[int, list[int]] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # The command name may hold spaces and parentheses: the fields after the last ')' are fixed.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    page = os.sysconf("SC_PAGE_SIZE")
    total, todo, seen = 0, [pid], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            total += int((proc / str(current) / "statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            if current == pid:
                return None
            continue
        todo += parents.get(current, [])
    return total


def find_local_server(url: str, proc: Path = Path("/proc")) -> Optional[int]:
    """The pid of the tritonserver on this machine that serves gRPC at `url`; None if it is elsewhere or unseen."""
    parts = urlsplit(f"//{url}")
    if parts.hostname not in ("127.0.0.1", "localhost", "::1", "0.0.0.0") or parts.port is None:
        return None
    for cmdline in proc.glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if not argv or Path(argv[0]).name != "tritonserver":
            continue
        ports = [arg.split("=", 1)[1] for arg in argv if arg.startswith("--grpc-port=")]
        if (ports[-1] if ports else "8001") == str(parts.port):  # 8001: Triton's default gRPC port
            return int(cmdline.parent.name)
    return None


@contextmanager
def _memory_sampler(pid: Optional[int], interval_s: float) -> Iterator[list[int]]:
    """Samples the server's RSS into the yielded list from entry to exit (once at each end, and every interval)."""
    samples: list[int] = []
    if pid is None:
        yield samples
        return
    stop = threading.Event()

    def sample() -> None:
        rss = process_tree_rss(pid)
        if rss is not None:
            samples.append(rss)

    def loop() -> None:
        while not stop.wait(interval_s):
            sample()

    sample()
    sampler = threading.Thread(target=loop, name="loadtest-rss", daemon=True)
    sampler.start()
    try:
        yield samples
    finally:
        stop.set()
        sampler.join()
        sample()


# ---- a whole run ----------------------------------------------------------------------------------


def request_tensors(prompt: str, cfg: LoadConfig) -> dict[str, np.ndarray]:
    """tensorrtllm_backend's tensors only (names, dtypes, [1, 1] shapes): the request any TRT-LLM client sends."""
    tensors = {
        "text_input": np.array([[prompt.encode("utf-8")]], dtype=np.object_),
        "max_tokens": np.array([[cfg.max_tokens]], dtype=np.int32),
        "stream": np.array([[True]], dtype=bool),
        "exclude_input_in_output": np.array([[True]], dtype=bool),
        "return_perf_metrics": np.array([[True]], dtype=bool),
    }
    if cfg.ignore_eos:
        tensors["end_id"] = np.array([[-1]], dtype=np.int32)  # TensorRT-LLM: -1 = generate max_tokens regardless
    if cfg.num_draft_tokens is not None:
        tensors["num_draft_tokens"] = np.array([[cfg.num_draft_tokens]], dtype=np.int32)
    return tensors


Progress = Callable[[str, int, int], None]  # (what, done, total)


def run_load(cfg: LoadConfig, url: str, *, model_name: str, server_pid: Optional[int] = None,
             progress: Optional[Progress] = None) -> list[dict]:
    """Warm-up, then one level per concurrency against the server at `url`: the level rows, in order."""
    from specpipe.bench.prompts import packaged_set, read_prompt_file

    prompt_set = read_prompt_file(cfg.prompts) if cfg.prompts else packaged_set(cfg.prompt_set)
    prompts = [p.prompt for p in prompt_set.prompts]
    make_request = lambda index: request_tensors(prompts[index % len(prompts)], cfg)  # noqa: E731
    report = progress or (lambda what, done, total: None)

    if cfg.warmup_requests:
        report("warm-up", 0, cfg.warmup_requests)
        warmup = run_level(url, model_name, make_request, 1, cfg.warmup_requests, timeout_s=cfg.request_timeout_s)
        failed = [r for r in warmup.records if r.error is not None]
        if failed:  # the server cannot answer at all: no point in measuring its errors at every level
            raise ServerError(f"warm-up request failed: {failed[0].error}")
    rows = []
    for concurrency in cfg.concurrency:
        what, done, requests = f"{concurrency} users", [0], cfg.requests_at(concurrency)

        def tick(record: RequestRecord) -> None:
            done[0] += 1
            report(what, done[0], requests)

        report(what, 0, requests)
        level = run_level(url, model_name, make_request, concurrency, requests, timeout_s=cfg.request_timeout_s,
                          server_pid=server_pid, rss_interval_s=cfg.rss_interval_s, on_done=tick)
        rows.append({**summarize_level(level), "records": [r.as_dict() for r in level.records]})
    return rows


def run_loadtest(cfg: LoadConfig, *, target: Optional[Path] = None, url: Optional[str] = None,
                 model_name: Optional[str] = None, progress: Optional[Progress] = None,
                 log: Callable[[str], None] = lambda line: None) -> dict:
    """Drive the server for `target` (a Triton repository, or engines/NAME served from a temporary repository of
    hard links), started here on free loopback ports and stopped after; or the running server at `url`."""
    from specpipe.machine import describe_machine
    from specpipe.manifest import now_iso
    from specpipe.triton.client import DEFAULT_MODEL

    if (target is None) == (url is None):
        raise UsageError("give TARGET (a Triton repository or engines/NAME) or --url, not both")
    model_name = model_name or DEFAULT_MODEL
    started_iso = now_iso()
    with ExitStack() as stack:
        if url is not None:
            from specpipe.triton.client import check_ready

            check_ready(url, model_name)
            server_pid, served, where = find_local_server(url), {}, url
            if server_pid is None:
                log(f"no tritonserver serving {url} on this machine: its memory is not measured")
        else:
            repo = stack.enter_context(_repository(Path(target), model_name))
            served = _served_model(repo, model_name)
            server = stack.enter_context(_started_server(repo, log))
            url, server_pid, where = server.url, server.process.pid, str(target)
        rows = run_load(cfg, url, model_name=model_name, server_pid=server_pid, progress=progress)
    return {
        "label": run_label(cfg, where),
        "target": where,
        "model": model_name,
        "started": started_iso,
        "settings": cfg.model_dump(mode="json"),
        "served": served,
        "machine": describe_machine(served.get("threads_per_instance")).as_dict(),
        "levels": rows,
    }


def run_label(cfg: LoadConfig, where: str | Path) -> str:
    """--label, else the target's folder name (or the URL), with the K requests ask for."""
    if cfg.label:
        return cfg.label
    label = Path(where).name or str(where)
    return label if cfg.num_draft_tokens is None else f"{label} K={cfg.num_draft_tokens}"


@contextmanager
def _repository(target: Path, model_name: str) -> Iterator[Path]:
    """`target` itself when it is a Triton repository; for engines/NAME, a temporary one beside it (hard links
    need the same filesystem), removed afterwards."""
    import shutil

    from specpipe.triton.repository import write_repository

    if not target.is_dir():
        raise UsageError(f"no such Triton repository or engines folder: {target}")
    if not (target / "manifest.json").is_file():
        yield target
        return
    scratch = Path(tempfile.mkdtemp(prefix=f".loadtest-{target.name}-", dir=target.resolve().parent))
    try:
        write_repository(target, scratch / "repo", model_name=model_name)
        yield scratch / "repo"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextmanager
def _started_server(repo: Path, log: Callable[[str], None]):
    from specpipe.triton.server import ServerConfig, TritonServer, free_port

    config = ServerConfig(grpc_port=free_port(), http_port=free_port(), metrics_port=free_port())
    with TritonServer(repo, config) as server:
        if server.leftovers:
            log(server.leftovers_note())
        log(f"tritonserver ready at {server.url} in {server.ready_s:.1f} s")
        yield server


def _served_model(repo: Path, model_name: str) -> dict:
    """What the repository's config says about the served model: instances and their engine threads."""
    from specpipe.triton.model_config import read_config
    from specpipe.triton.repository import ModelParameters

    model_dir = repo / model_name
    if not (model_dir / "config.pbtxt").is_file():
        models = sorted(p.name for p in repo.iterdir() if (p / "config.pbtxt").is_file())
        raise UsageError(f"{repo} has no model {model_name!r} (models: {', '.join(models) or 'none'}); see --model")
    config = read_config(model_dir)
    instances = sum(group.count for group in config.instance_group) or 1
    raw = {key: value.string_value for key, value in config.parameters.items()}
    parameters = ModelParameters(**{key: value for key, value in raw.items() if key in ModelParameters.model_fields})
    return {"instances": instances, "max_batch_size": config.max_batch_size,
            "threads_per_instance": parameters.threads_per_instance(instances, os.cpu_count())}


# ---- reports --------------------------------------------------------------------------------------


def make_report(runs: list[dict]) -> dict:
    """One report of several runs (rows), each label once."""
    labels = [run["label"] for run in runs]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise UsageError(f"two runs are labelled {', '.join(map(repr, twice))}: give each run its own --label")
    return {"schema": SCHEMA, "runs": runs}


def read_reports(paths: list[Path]) -> list[dict]:
    """The runs in loadtest JSON files (each a report of one run or more), in order."""
    import json

    runs = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as err:
            raise UsageError(f"--compare {path}: {err.strerror or err}") from None
        except ValueError as err:
            raise UsageError(f"--compare {path}: not JSON ({err})") from None
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("runs"), list):
            raise UsageError(f"--compare {path}: not a loadtest report (schema {SCHEMA})")
        runs += data["runs"]
    return runs
