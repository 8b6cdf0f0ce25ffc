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
- steady_tokens_per_s: tokens that arrived while every user had a request in flight / that window (the last
  user's first request sent -> the first user's last request done): no ramp-up, no tail; runs compare on it.
- request_tokens_per_s: a request's tokens / its latency (sent -> last response, queueing included); p50.
- errors: requests the server refused, or that failed or timed out on the way, each with its message. They count
  in `requests` and `errors` and in no latency statistic.
- rss_mb: tritonserver and its Python-backend stubs (its child processes) together, sampled during the level;
  growth_pct = end / start - 1. Pages the processes share (the stubs' shared memory) are counted in each.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from specpipe.bench.config import LoadConfig
from specpipe.errors import ServerError, UsageError

SCHEMA = "specpipe.loadtest/1"
from specpipe.triton.load import (  # noqa: F401 (the level machinery lives with the server it drives)
    LevelRun,
    RequestMaker,
    RequestRecord,
    find_local_server,
    first_requests,
    itl_samples,
    percentile,
    process_tree_rss,
    rss_summary,
    run_level,
    summarize_level,
)


def request_tensors(prompt: str, cfg: LoadConfig, num_draft_tokens: Optional[int] = None) -> dict[str, np.ndarray]:
    """tensorrtllm_backend's tensors only (names, dtypes, [1, 1] shapes): the request any TRT-LLM client sends.
    `num_draft_tokens` (else cfg's) goes in the request when given; None leaves the deployment's own K."""
    tensors = {
        "text_input": np.array([[prompt.encode("utf-8")]], dtype=np.object_),
        "max_tokens": np.array([[cfg.max_tokens]], dtype=np.int32),
        "stream": np.array([[True]], dtype=bool),
        "exclude_input_in_output": np.array([[True]], dtype=bool),
        "return_perf_metrics": np.array([[cfg.perf_metrics]], dtype=bool),
    }
    if cfg.ignore_eos:
        tensors["end_id"] = np.array([[-1]], dtype=np.int32)  # TensorRT-LLM: -1 = generate max_tokens regardless
    k = cfg.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
    if k is not None:
        tensors["num_draft_tokens"] = np.array([[k]], dtype=np.int32)
    return tensors


Progress = Callable[[str, int, int], None]  # (what, done, total)
TARGET_ONLY = " target-only"  # suffix of the K = 0 run's label (--against-target-only)


def run_load(cfg: LoadConfig, url: str, *, model_name: str, server_pid: Optional[int] = None,
             progress: Optional[Progress] = None, alone=None) -> dict[str, list[dict]]:
    """Warm-up, then one level per concurrency against the server at `url`: the level rows, in order, by variant
    ("" = as deployed; TARGET_ONLY = K 0 in every request, with cfg.against_target_only, run on the same server
    level by level, alternating which variant goes first so drift over the run does not favour either).
    `alone` (bench/load_alone.py `EngineAlone`): after each level, the served engine alone on the level's first
    requests, in each row's `engine_alone`."""
    from specpipe.bench.prompts import packaged_set, read_prompt_file

    prompt_set = read_prompt_file(cfg.prompts) if cfg.prompts else packaged_set(cfg.prompt_set)
    prompts = [p.prompt for p in prompt_set.prompts]
    report = progress or (lambda what, done, total: None)

    def requests_with(k: Optional[int]) -> RequestMaker:
        return lambda index: request_tensors(prompts[index % len(prompts)], cfg, k)

    stagger_s = 0.0
    if cfg.warmup_requests:
        report("warm-up", 0, cfg.warmup_requests)
        warmup = run_level(url, model_name, requests_with(None), 1, cfg.warmup_requests, timeout_s=cfg.request_timeout_s)
        failed = [r for r in warmup.records if r.error is not None]
        if failed:  # the server cannot answer at all: no point in measuring its errors at every level
            raise ServerError(f"warm-up request failed: {failed[0].error}")
        if cfg.arrivals == "staggered":  # one request's latency alone: users' first requests spread over it
            stagger_s = float(np.median([r.total_ms for r in warmup.records])) / 1e3
    variants = {"": None, TARGET_ONLY: 0} if cfg.against_target_only else {"": None}
    rows: dict[str, list[dict]] = {name: [] for name in variants}
    for n, concurrency in enumerate(cfg.concurrency):
        first = list(variants) if n % 2 == 0 else list(reversed(variants))
        # Two variants: each runs its requests in two halves, in the order A B B A, so that a drift of the
        # machine's speed that is linear over the level weighs on both alike (this machine's drifts by up to 30%
        # over minutes); the first variant alternates from level to level.
        order, parts = (first + first[::-1], 2) if len(first) > 1 else (first, 1)
        levels: dict[str, list[LevelRun]] = {name: [] for name in variants}
        for name in order:
            requests = -(-cfg.requests_at(concurrency) // parts)
            part = f" ({len(levels[name]) + 1}/{parts})" if parts > 1 else ""
            what, done = f"{concurrency} users{name}{part}", [0]

            def tick(record: RequestRecord, what=what, done=done, requests=requests) -> None:
                done[0] += 1
                report(what, done[0], requests)

            report(what, 0, requests)
            levels[name].append(run_level(url, model_name, requests_with(variants[name]), concurrency, requests,
                                          timeout_s=cfg.request_timeout_s, server_pid=server_pid,
                                          rss_interval_s=cfg.rss_interval_s, stagger_s=stagger_s, on_done=tick))
        for name in variants:
            row = {**summarize_parts(levels[name]), "stagger_s": stagger_s, "engine_alone": None}
            if alone is not None:
                from specpipe.bench.load_alone import compare

                report(f"{concurrency} users{name}: the engine alone", 0, 1)
                users = min(concurrency, cfg.requests_at(concurrency))
                first = [requests_with(variants[name])(index) for index in range(users)]
                row["engine_alone"] = compare(row, alone.measure(first, burst=cfg.arrivals == "burst"))
            rows[name].append({**row, "records": [r.as_dict() for level in levels[name] for r in level.records]})
    return rows


def summarize_parts(parts: list[LevelRun]) -> dict:
    """One level's row from the runs it was split into: every request's numbers together, the time of all, and
    the steady rate as the mean of each part's (each has its own ramp-up and tail)."""
    if len(parts) == 1:
        return summarize_level(parts[0])
    merged = LevelRun(parts[0].concurrency, [r for part in parts for r in part.records], sum(p.wall_s for p in parts),
                      [b for part in parts for b in part.rss_bytes])
    steady = [summarize_level(part)["steady_tokens_per_s"] for part in parts]
    first = [r.ttft_ms for part in parts for r in first_requests([r for r in part.records if r.error is None])]
    return {**summarize_level(merged), "steady_tokens_per_s": None if None in steady else float(np.mean(steady)),
            "first_ttft_ms_p95": percentile(first, 95)}  # every part's users start anew


def run_loadtest(cfg: LoadConfig, *, target: Optional[Path] = None, url: Optional[str] = None,
                 model_name: Optional[str] = None, progress: Optional[Progress] = None,
                 log: Callable[[str], None] = lambda line: None) -> list[dict]:
    """Drive the server for `target` (a Triton repository, or engines/NAME served from a temporary repository of
    hard links), started here on free loopback ports and stopped after; or the running server at `url`.
    One run (dict) per variant (run_load): one, or two with cfg.against_target_only."""
    from specpipe.contract.manifest import now_iso
    from specpipe.machine import describe_machine
    from specpipe.triton.client import DEFAULT_MODEL

    if (target is None) == (url is None):
        raise UsageError("give TARGET (a Triton repository or engines/NAME) or --url, not both")
    model_name = model_name or DEFAULT_MODEL
    started_iso = now_iso()
    alone = None  # the served engine alone, beside the server (TARGET only: a --url server's engines are not here)
    with ExitStack() as stack:
        if url is not None:
            from specpipe.triton.client import check_ready

            check_ready(url, model_name)
            server_pid, served, where = find_local_server(url), {}, url
            if server_pid is None:
                log(f"no tritonserver serving {url} on this machine: its memory is not measured")
        else:
            repo = stack.enter_context(_repository(Path(target), model_name, stream_interval=cfg.stream_interval))
            served = _served_model(repo, model_name)
            server = stack.enter_context(_started_server(repo, log))
            url, server_pid, where = server.url, server.process.pid, str(target)
            if cfg.engine_alone:
                from specpipe.bench.load_alone import EngineAlone

                alone = EngineAlone.of_repository(repo, model_name)
        rows = run_load(cfg, url, model_name=model_name, server_pid=server_pid, progress=progress, alone=alone)
    machine = describe_machine(served.get("threads_per_instance")).as_dict()
    settings = cfg.model_dump(mode="json")
    return [{
        "label": label,
        "target": where,
        "model": model_name,
        "started": started_iso,
        "settings": {**settings, "num_draft_tokens": 0} if suffix else settings,
        "served": served,
        "machine": machine,
        "levels": rows[suffix],
    } for suffix, label in zip(rows, run_labels(cfg, where))]


def run_label(cfg: LoadConfig, where: str | Path) -> str:
    """--label, else the target's folder name (or the URL), with the K requests ask for."""
    if cfg.label:
        return cfg.label
    label = Path(where).name or str(where)
    return label if cfg.num_draft_tokens is None else f"{label} K={cfg.num_draft_tokens}"


def run_labels(cfg: LoadConfig, where: str | Path) -> list[str]:
    """The labels of the runs run_loadtest returns, in its order."""
    label = run_label(cfg, where)
    return [label, label + TARGET_ONLY] if cfg.against_target_only else [label]


@contextmanager
def _repository(target: Path, model_name: str, *, stream_interval: Optional[int] = None) -> Iterator[Path]:
    """`target` itself when it is a Triton repository; for engines/NAME, a temporary one beside it (hard links
    need the same filesystem), removed afterwards, streaming `stream_interval` tokens a response when given."""
    import shutil

    from specpipe.triton.repository import write_repository

    if not target.is_dir():
        raise UsageError(f"no such Triton repository or engines folder: {target}")
    if not (target / "manifest.json").is_file():
        if stream_interval is not None:
            raise UsageError(f"--stream-interval applies to a built deployment (engines/NAME); {target} is a repository: "
                             "its config.pbtxt's stream_interval parameter decides")
        yield target
        return
    scratch = Path(tempfile.mkdtemp(prefix=f".loadtest-{target.name}-", dir=target.resolve().parent))
    try:
        write_repository(target, scratch / "repo", model_name=model_name, stream_interval=stream_interval or 1)
        yield scratch / "repo"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextmanager
def _started_server(repo: Path, log: Callable[[str], None]):
    from specpipe.triton.server import ServerConfig, TritonServer

    config = ServerConfig.on_free_ports()
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
    return {"instances": instances, "requests_batched": _requests_batched(model_dir, parameters),
            "threads_per_instance": parameters.threads_per_instance(instances, os.cpu_count()),
            "stream_interval": parameters.stream_interval}


def _requests_batched(model_dir: Path, parameters) -> int:
    """Requests one instance decodes together: the model's max_batch_size parameter, else its build's
    (manifest `serving`; 1 for builds made before continuous batching). config.pbtxt's own max_batch_size is
    the request tensors' batch dimension, not this."""
    from specpipe.drafts import read_manifest

    if parameters.max_batch_size:
        return parameters.max_batch_size
    engine_dir = model_dir / "1" / parameters.engine_dir
    try:
        return read_manifest(engine_dir).serving.max_batch_size
    except Exception:  # not a specpipe deployment (another server's model): unknown
        return 0


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
