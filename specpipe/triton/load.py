"""One level of load on a Triton server: closed-loop streaming users, what each request saw, and the server's
memory while they ran. Shared by `specpipe loadtest` (bench/load.py, which states the conventions) and the
gate's latency check through a server (gate/server.py).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional
from urllib.parse import urlsplit

import numpy as np

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
    def drafted(self) -> Optional[int]:
        """Draft tokens the server's decoder proposed for this request (its statistics); None if not reported."""
        return self.result.get("drafted")

    @property
    def accepted(self) -> Optional[int]:
        return self.result.get("accepted")

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft_ms(self) -> Optional[float]:
        return self.chunk_ms[0] if self.chunk_ms else None

    def as_dict(self) -> dict:
        return {"index": self.index, "stream": self.stream, "sent_ms": self.sent_ms, "ttft_ms": self.ttft_ms,
                "total_ms": self.total_ms, "tokens": self.tokens, "responses": len(self.chunk_ms),
                "steps": self.result.get("steps"), "drafted": self.drafted, "accepted": self.accepted,
                "error": self.error}


@dataclass
class LevelRun:
    concurrency: int
    records: list[RequestRecord]
    wall_s: float
    rss_bytes: list[int] = field(default_factory=list)  # server memory samples in time order; [] = not measurable


def run_level(url: str, model_name: str, make_request: RequestMaker, concurrency: int, requests: int, *,
              timeout_s: float = 600.0, server_pid: Optional[int] = None, rss_interval_s: float = 0.5,
              stagger_s: float = 0.0, on_done: Optional[Callable[[RequestRecord], None]] = None) -> LevelRun:
    """`requests` requests (make_request(0), (1), ...) sent by `concurrency` closed-loop streaming users, each its
    share (user n: requests n, n + concurrency, ...).

    With `stagger_s` > 0, user n sends its first request n * stagger_s / concurrency seconds after the level
    starts, instead of all users at once. Closed-loop users whose requests have equal lengths keep the phase they
    start with (a batched server advances every row one step at a time), so users started together arrive
    together for the whole level: `stagger_s` = one request's latency spreads them over a request's length, as
    independent users are."""
    import tritonclient.grpc as grpcclient

    from specpipe.triton.client import RemoteGeneration

    lock = threading.Lock()
    records: list[RequestRecord] = []
    users = min(concurrency, requests)

    def user(stream: int) -> None:
        client = grpcclient.InferenceServerClient(url)
        try:
            time.sleep(max(0.0, started + stream * stagger_s / concurrency - time.perf_counter()))
            # User n sends requests n, n + users, n + 2 users, ...: each user its own share, one after another, so
            # every user of the level is one (a shared queue let early users drain it before a late one started).
            for index in range(stream, requests, users):
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
        threads = [threading.Thread(target=user, args=(n,), name=f"loadtest-user-{n}", daemon=True)
                   for n in range(users)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
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
    drafted = [r for r in done if r.drafted is not None and r.accepted is not None]
    drafted_tokens = sum(r.drafted for r in drafted)
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
        "steady_tokens_per_s": steady_tokens_per_s(done, level.concurrency),
        "request_tokens_per_s_p50": percentile(request_rates, 50),
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p95": percentile(ttft, 95),
        # each user's first request: with burst arrivals, the burst (every prompt sent at once)
        "first_ttft_ms_p95": percentile([r.ttft_ms for r in first_requests(done)], 95),
        "itl_ms_p50": percentile(itl, 50),
        "itl_ms_p95": percentile(itl, 95),
        "rss_mb": rss_summary(level.rss_bytes),
        # Speculation as the server reports it: drafted tokens per output token (0 = the target alone) and the
        # share of them accepted.
        "drafted_per_token": drafted_tokens / tokens if drafted and tokens else (0.0 if drafted else None),
        "acceptance": sum(r.accepted for r in drafted) / drafted_tokens if drafted_tokens else None,
    }


def first_requests(records: list[RequestRecord]) -> list[RequestRecord]:
    """Each user's first request (its lowest index)."""
    first: dict[int, RequestRecord] = {}
    for record in records:
        if record.stream not in first or record.index < first[record.stream].index:
            first[record.stream] = record
    return list(first.values())


def steady_tokens_per_s(records: list[RequestRecord], concurrency: int) -> Optional[float]:
    """Aggregate tokens/s while every user had a request in flight: from the last user's first request to the
    end of the first user's last one (tokens counted by when their response arrived). The level's own rate
    also counts the ramp-up and the tail, where fewer users are left; this one is what the server does at
    `concurrency`, so two runs compare on it. None when the window is empty or some user sent nothing."""
    streams: dict[int, list[RequestRecord]] = {}
    for record in records:
        streams.setdefault(record.stream, []).append(record)
    if len(streams) < concurrency or any(r.total_ms is None for r in records):
        return None
    start = max(min(r.sent_ms for r in rs) for rs in streams.values())
    end = min(max(r.sent_ms + r.total_ms for r in rs) for rs in streams.values())
    if end <= start:
        return None
    tokens = sum(n for r in records for at, n in zip(r.chunk_ms, r.chunk_tokens) if start <= r.sent_ms + at <= end)
    return tokens / ((end - start) / 1e3)


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
