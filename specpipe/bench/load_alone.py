"""The served engine alone, in the load generator's process, right after a level: the other side of the serving
criteria (docs/batching.md), measured the same minute as what the users received.

The deployment is opened as the served model opens it (`triton.serving.load_served`: the repository's engines,
its instance's threads, batching, blocking workers), and a level's prompts are encoded as the server encodes them
(`ServedModel.prepared`: the chat template when a request asks for it). For the first request of each user:

- decode: the prompts in rows of one batch (as many as the server decodes together), then `max_tokens - 1`
  one-token steps of all rows in one call each, as a full batch runs them: rows x steps / the time in those
  calls (median of `runs`). A served level's steady rate over this is the share of the engine the users got.
- burst prefill: every prompt waiting at once, prefilled by the scheduler's own prefill phase
  (`BatchScheduler.prefill_alone`: its prompts-per-call rule and `prefill_chunk`), no decode step between; the
  sum of its engine calls (median of `runs`). A burst's first-request TTFT p95 over this is how close the server
  comes to the compute a burst cannot avoid.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Optional

import numpy as np


class EngineAlone:
    def __init__(self, engine_dir: Path, params, instance_count: int):
        from specpipe.triton.serving import ServedModel, load_served

        self.model = ServedModel(load_served(engine_dir, params, instance_count))
        self.threads = params.threads_per_instance(instance_count, os.cpu_count())
        self.scheduler = self.model.deployment.generator.decoder

    @classmethod
    def of_repository(cls, repo: Path, model_name: str) -> "EngineAlone":
        from specpipe.triton.model_config import read_config
        from specpipe.triton.repository import ModelParameters, served_engine_dir

        config = read_config(Path(repo) / model_name)
        raw = {key: value.string_value for key, value in config.parameters.items()}
        params = ModelParameters(**{key: value for key, value in raw.items() if key in ModelParameters.model_fields})
        instances = sum(group.count for group in config.instance_group) or 1
        return cls(served_engine_dir(repo, model_name), params, instances)

    def measure(self, tensors: list[dict[str, np.ndarray]], *, burst: bool, runs: int = 5) -> dict:
        """`tensors`: the first request of each user of a level (the server's input tensors)."""
        prepared = [self.model.prepared(t) for t in tensors]
        prompts = [prompt_ids for _, _, prompt_ids, _ in prepared]
        steps = max(0, prepared[0][3].max_new_tokens - 1)
        result = {"threads": self.threads, "runs": runs, "decode": self.decode_rate(prompts, steps, runs)}
        if burst:
            result["burst_prefill"] = self.burst_prefill([(ids, cfg) for _, _, ids, cfg in prepared], runs)
        return result

    def decode_rate(self, prompts: list[list[int]], steps: int, runs: int) -> Optional[dict]:
        if steps < 1:
            return None
        rows = min(len(prompts), getattr(self.scheduler, "max_batch_size", 1))
        target = self.model.deployment.target
        batch = target.new_batch(rows)
        rates = []
        for _ in range(runs + 1):  # the first is a warm-up
            sequences = [batch.new_sequence() for _ in range(rows)]
            batch.prefill(sequences, prompts[:rows])
            tokens = [ids[-1] for ids in prompts[:rows]]  # what a token is does not change a call's cost
            spent = 0.0
            for _ in range(steps):
                t0 = time.perf_counter()
                batch.decode(sequences, tokens)
                spent += time.perf_counter() - t0
            for sequence in sequences:
                batch.release(sequence)
            rates.append(rows * steps / spent)
        rates = rates[1:]
        return {"rows": rows, "steps": steps, "tokens_per_s": statistics.median(rates),
                "step_ms": rows / statistics.median(rates) * 1e3, "runs_tokens_per_s": rates}

    def burst_prefill(self, requests: list, runs: int) -> dict:
        from specpipe.speculative.batching import BatchScheduler

        if not isinstance(self.scheduler, BatchScheduler):
            return {"ms": None, "note": "this deployment serves one request at a time"}
        totals, calls = [], []
        for n in range(runs + 1):  # the first is a warm-up
            trace = self.scheduler.prefill_alone(requests)
            if n:
                totals.append(sum(t1 - t0 for _, _, _, t0, t1 in trace.calls) * 1e3)
                calls = [[kind, rows, tokens] for kind, rows, tokens, _, _ in trace.calls]
        return {"prompts": len(requests), "prompt_tokens": sum(len(ids) for ids, _ in requests), "calls": calls,
                "ms": statistics.median(totals), "runs_ms": totals}


def compare(row: dict, alone: dict) -> dict:
    """A level's row with the engine alone beside it: the served steady rate's share of the decode rate, and the
    first requests' TTFT p95 over the burst's prefill."""
    decode, burst = alone.get("decode"), alone.get("burst_prefill")
    served = row.get("steady_tokens_per_s") or row.get("tokens_per_s")
    alone = dict(alone)
    alone["served_share"] = served / decode["tokens_per_s"] if decode and served else None
    if burst is not None:
        first = row.get("first_ttft_ms_p95")
        alone["burst_ttft_ratio"] = first / burst["ms"] if first and burst.get("ms") else None
    return alone
