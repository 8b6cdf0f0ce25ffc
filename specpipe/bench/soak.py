"""A soak through the real Triton server: `streams` closed-loop streaming users send `requests_per_stream`
requests each, cycling through a mix of prompts, lengths and sampling settings (`request_mix`). It passes with

- 0 errors,
- the server's memory (tritonserver and its stubs) growing by less than `rss_growth_limit` from a baseline taken
  when `rss_baseline_after` of the requests are done to the end (after a warm-up round that sends every setting
  once; the engines' arenas and allocators still grow over the first few hundred requests of the mix, by ~10%
  here, then flatten; a leak keeps growing), and
- every greedy output equal to the same request decoded alone in process (batch 1, the same deployment), under
  the project's near-tie rule (speculative/equivalence.py): batching, speculation, other users' settings and
  the hours a server has run must not change what a greedy request gets.

    report = run_soak(SoakConfig(), Path("engines/smollm2-demo"))   # `make soak`
    report.failures -> [] when it passed
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from specpipe.bench.config import SoakConfig
from specpipe.contract.generation import GenerationConfig, SamplingConfig

Progress = Callable[[str, int, int], None]  # (what, done, total)


def request_mix(max_tokens: list[int]) -> list[GenerationConfig]:
    """The settings requests cycle through: greedy as deployed, greedy target-only, greedy with a fixed K, greedy
    without stopping at EOS, and two seeded samplers; each at every length of `max_tokens`, longest first."""
    kinds = [
        dict(),
        dict(speculative=False),
        dict(num_draft_tokens=3, draft_length="fixed"),
        dict(stop_on_eos=False),
        dict(sampling=SamplingConfig(temperature=0.8, top_p=0.9), seed=7),
        dict(sampling=SamplingConfig(temperature=1.0, top_k=20), seed=11),
    ]
    return [GenerationConfig(max_new_tokens=n, **kind) for n in sorted(max_tokens, reverse=True) for kind in kinds]


def is_greedy(cfg: GenerationConfig) -> bool:
    return cfg.sampling.greedy


@dataclass
class SoakReport:
    requests: int
    errors: list[str]
    rss_mb: tuple[Optional[float], Optional[float]]  # (the baseline, at the end)
    rss_series_mb: list[float]  # the soak's samples, at most 60 evenly spaced: a step or a slope
    greedy_checked: int
    mismatches: list[dict]  # greedy outputs that differ from their batch-1 output beyond a near-tie
    near_ties: int  # greedy outputs that differ only after a near-tie (allowed)
    tokens: int
    wall_s: float
    rss_growth_limit: float
    failures: list[str] = field(default_factory=list)

    @property
    def rss_growth(self) -> Optional[float]:
        start, end = self.rss_mb
        return None if not start or end is None else end / start - 1

    def judge(self) -> "SoakReport":
        """Every failed condition, each with its numbers (empty: passed)."""
        self.failures = []
        if self.errors:
            self.failures.append(f"{len(self.errors)} of {self.requests} requests failed, first: {self.errors[0]}")
        if self.rss_growth is None:
            self.failures.append("the server's memory could not be measured")
        elif self.rss_growth >= self.rss_growth_limit:
            self.failures.append(f"server memory grew {self.rss_growth:.1%} ({self.rss_mb[0]:.0f} -> {self.rss_mb[1]:.0f} MB),"
                                 f" limit {self.rss_growth_limit:.0%}")
        if self.mismatches:
            first = self.mismatches[0]
            self.failures.append(f"{len(self.mismatches)} of {self.greedy_checked} greedy outputs differ from their "
                                 f"batch-1 output beyond a near-tie, first: request {first['index']} at token "
                                 f"{first['position']}")
        return self

    def as_dict(self) -> dict:
        return {"requests": self.requests, "errors": len(self.errors), "error_messages": self.errors[:5],
                "rss_mb": list(self.rss_mb), "rss_series_mb": self.rss_series_mb, "rss_growth": self.rss_growth, "rss_growth_limit": self.rss_growth_limit,
                "greedy_checked": self.greedy_checked, "near_ties": self.near_ties, "mismatches": self.mismatches,
                "tokens": self.tokens, "wall_s": self.wall_s, "tokens_per_s": self.tokens / self.wall_s if self.wall_s else None,
                "passed": not self.failures, "failures": self.failures}


class BatchOneReference:
    """Each greedy (prompt, settings) decoded alone in process, once (requests repeat), and the near-tie rule."""

    def __init__(self, engines: Path, threads: int):
        from specpipe.deployment import load_deployment
        from specpipe.speculative.equivalence import near_tie_tolerance

        self.deployment = load_deployment(engines, threads=threads)  # no batching: every request alone
        self.tolerance = near_tie_tolerance(self.deployment.manifest.target.quant_mode)
        self._outputs: dict[tuple[str, str], list[int]] = {}

    def output(self, prompt: str, cfg: GenerationConfig) -> list[int]:
        key = (prompt, cfg.model_dump_json())
        if key not in self._outputs:
            settings = self.deployment.generation_config(**cfg.model_dump())
            self._outputs[key] = list(self.deployment.generator.generate(prompt, settings).token_ids)
        return self._outputs[key]

    def divergence(self, prompt: str, cfg: GenerationConfig, served: list[int]):
        """None when `served` equals the batch-1 output; else the first divergence (`.near_tie` says if allowed)."""
        from specpipe.speculative.equivalence import compare_greedy

        alone = self.output(prompt, cfg)
        if served == alone:
            return None
        prompt_ids = self.deployment.generator.encode(prompt)
        return compare_greedy(self.deployment.target, prompt_ids, served, alone, self.tolerance)


def check_greedy(records, requests: list[tuple[str, GenerationConfig]], reference) -> tuple[int, list[dict], int]:
    """(greedy requests checked, mismatches beyond a near-tie, near-tie divergences) of the finished records."""
    checked, mismatches, near_ties = 0, [], 0
    for record in records:
        prompt, cfg = requests[record.index]
        if record.error is not None or not is_greedy(cfg):
            continue
        checked += 1
        divergence = reference.divergence(prompt, cfg, list(record.result["token_ids"]))
        if divergence is None:
            continue
        if divergence.near_tie:
            near_ties += 1
        else:
            mismatches.append({"index": record.index, "prompt": prompt, "settings": cfg.model_dump(mode="json"),
                               **divergence.as_dict()})
    return checked, mismatches, near_ties


def run_soak(cfg: SoakConfig, engines: Path, *, progress: Optional[Progress] = None,
             log: Callable[[str], None] = lambda line: None) -> SoakReport:
    """Serve `engines` (a built deployment) from a temporary repository on free loopback ports, soak it, judge."""
    from specpipe.bench.load import _repository, _started_server
    from specpipe.bench.prompts import packaged_set
    from specpipe.triton.client import DEFAULT_MODEL, request_tensors
    from specpipe.triton.load import process_tree_rss, run_level

    prompts = [p.prompt for p in packaged_set(cfg.prompt_set).prompts]
    mix = request_mix(cfg.max_tokens)
    total = cfg.streams * cfg.requests_per_stream
    # Request i: prompt i mod P, settings (i + i // P) mod M: consecutive requests differ in both, and over the
    # soak every prompt meets every setting.
    requests = [(prompts[i % len(prompts)], mix[(i + i // len(prompts)) % len(mix)]) for i in range(total)]
    make = lambda i, reqs=requests: request_tensors(reqs[i][0], reqs[i][1], stream=True)  # noqa: E731
    warm = max(cfg.streams, len(mix))  # every setting once: request j is prompt j mod P with setting j mod M
    make_warm = lambda j: request_tensors(prompts[j % len(prompts)], mix[j % len(mix)], stream=True)  # noqa: E731
    report = progress or (lambda what, done, total: None)
    with ExitStack() as stack:
        repo = stack.enter_context(_repository(Path(engines), DEFAULT_MODEL))
        server = stack.enter_context(_started_server(repo, log))
        pid = server.process.pid
        report("warm-up", 0, warm)
        warmup = run_level(server.url, DEFAULT_MODEL, make_warm, cfg.streams, warm, server_pid=pid,
                           timeout_s=cfg.request_timeout_s)
        done, baseline = [0], []

        def tick(record) -> None:
            done[0] += 1
            report("soak", done[0], total)
            if done[0] == max(1, int(total * cfg.rss_baseline_after)):
                baseline.append(process_tree_rss(pid))

        level = run_level(server.url, DEFAULT_MODEL, make, cfg.streams, total, server_pid=pid,
                          timeout_s=cfg.request_timeout_s, on_done=tick)
    rss = ([b for b in baseline if b], level.rss_bytes[-1:])
    reference = BatchOneReference(Path(engines), cfg.threads)
    checked, mismatches, near_ties = check_greedy(level.records, requests, reference)
    errors = [f"request {r.index}: {r.error}" for r in warmup.records + level.records if r.error is not None]
    return SoakReport(
        requests=len(level.records), errors=errors,
        rss_mb=tuple(b[0] / 2**20 if b else None for b in rss),
        rss_series_mb=[round(b / 2**20, 1) for b in level.rss_bytes[:: max(1, len(level.rss_bytes) // 60)]], greedy_checked=checked, mismatches=mismatches,
        near_ties=near_ties, tokens=sum(r.tokens for r in level.records if r.error is None), wall_s=level.wall_s,
        rss_growth_limit=cfg.rss_growth_limit,
    ).judge()


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m specpipe.bench.soak ENGINES [--streams N] [--requests-per-stream N] [--json-out PATH]`."""
    import argparse
    import json

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeRemainingColumn

    from specpipe.config import make_config
    from specpipe.errors import SpecpipeError

    parser = argparse.ArgumentParser(prog="python -m specpipe.bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("engines", type=Path, help="a built deployment (engines/NAME)")
    parser.add_argument("--streams", type=int, default=None)
    parser.add_argument("--requests-per-stream", type=int, default=None)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    try:
        given = {"streams": args.streams, "requests_per_stream": args.requests_per_stream}
        cfg = make_config(SoakConfig, **{name: value for name, value in given.items() if value is not None})
        if not (args.engines / "manifest.json").is_file():
            raise SpecpipeError(f"{args.engines} is not a built deployment (no manifest.json): run `make demo` first")
        with Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                 console=console) as bar:
            task = bar.add_task("soak", total=None)
            result = run_soak(cfg, args.engines, log=console.print,
                              progress=lambda what, done, total: bar.update(task, description=what, completed=done, total=total))
    except SpecpipeError as err:
        console.print(f"error: {err}", markup=False)
        return 2
    summary = result.as_dict()
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(summary, indent=1))
    growth = "unmeasured" if result.rss_growth is None else f"{result.rss_growth:+.1%}"
    console.print(f"{result.requests} requests, {len(result.errors)} errors, {summary['tokens_per_s'] or 0:.1f} tokens/s, "
                  f"server memory {growth}, greedy outputs equal to batch 1: {result.greedy_checked - len(result.mismatches)}"
                  f"/{result.greedy_checked} ({result.near_ties} after a near-tie)", markup=False)
    for failure in result.failures:
        console.print(f"FAILED: {failure}", markup=False)
    return 1 if result.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
