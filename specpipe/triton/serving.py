"""One request on a Deployment: request tensors in, response tensors out, one response per decoding step.

Free of Triton imports, so the same code runs in-process (tests) and behind the Python backend, whose
model.py only converts tensors and sends. Response conventions (TensorRT-LLM's, where it has one):
- streamed: one response per speculative step that emitted tokens (1..K+1 of them), `text_output` the new
  text (whole characters only), then a final response with empty text, the totals and `stats_json`;
- not streamed: one final response with the whole text (prefixed with the prompt when
  exclude_input_in_output is false, as TensorRT-LLM does).
Perf outputs (times, acceptance counters) come when the request sets return_perf_metrics; specpipe has no
paged KV cache, so the kv_cache_* block counters are 0. A request in the llmapi model's names streams the whole
text so far in each response, as that model does, and gets finish_reason when it asks. `batched=False` serves
the llmapi model's shapes (max_batch_size 0: no leading batch dimension on the outputs).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional

import numpy as np
from pydantic import ValidationError

from specpipe.contract.generation import GenerationConfig
from specpipe.errors import UsageError
from specpipe.speculative.generator import Generation, SpecGenerator
from specpipe.triton.protocol import LLMAPI_FINISH_REASON, ServedRequest, parse_request
from specpipe.triton.repository import ModelParameters


def load_served(engine_dir: Path, params: ModelParameters, instance_count: int):
    """The deployment as the served model opens it (model.py's initialize; bench/load_alone.py measures the same
    beside a server): batching, the model's limits, the instance's share of the cores. Its target's worker
    threads block instead of spinning while they wait inside a call: spinning ones take the cores from this
    process's answering threads, tritonserver and the clients; on a loaded 2-core machine blocking served 16
    streams 1.3-1.8x faster, on a quiet one the two did not differ measurably (docs/batching.md)."""
    from specpipe.deployment import load_deployment

    return load_deployment(engine_dir, threads=params.threads_per_instance(instance_count, os.cpu_count()),
                           batching=True, max_batch_size=params.max_batch_size or None, max_queue=params.max_queue,
                           spinning=False)


@dataclass
class Reply:
    tensors: dict[str, np.ndarray]  # output name -> array with the batch dimension ([1, ...])
    final: bool


class ServedModel:
    """Wraps a loaded `specpipe.deployment.Deployment`; `replies()` answers one request."""

    def __init__(self, deployment, *, exclude_input_in_output: bool = True, batched: bool = True,
                 stream_interval: int = 1):
        from specpipe.speculative.batching import BatchScheduler

        if stream_interval < 1:
            raise UsageError(f"stream_interval must be >= 1, got {stream_interval}")
        self.deployment = deployment
        self.stream_interval = stream_interval
        # Requests decode together in one scheduler: the Triton model answers each on a thread of its own.
        self.batching = isinstance(deployment.generator.decoder, BatchScheduler)
        self.exclude_input_in_output = exclude_input_in_output
        self.batched = batched

    def replies(self, tensors: Mapping[str, np.ndarray]) -> Iterator[Reply]:
        """Validate, then generate. Bad requests raise UsageError before the first reply."""
        arrival_ns = time.time_ns()
        request, generator, prompt_ids, config = self.prepared(tensors)
        generation = generator.start(prompt_ids, config)  # checks the context
        clock = _Clock(arrival_ns)

        if request.stream:
            # A response carries the tokens since the last one once they reach stream_interval; the first goes at
            # once (time to first token), what is left rides on the final response.
            so_far, text, token_ids, sent = "", "", [], False
            for chunk in generation:
                clock.tick()
                so_far += chunk.text
                text += chunk.text
                token_ids += chunk.token_ids
                if sent and len(token_ids) < self.stream_interval:
                    continue
                reply = self._tensors(so_far if request.llmapi else text, token_ids, request, generation, clock)
                yield Reply(self._shaped(reply), final=False)
                text, token_ids, sent = "", [], True
            final = self._final(generation, so_far if request.llmapi else text, token_ids, request, clock)
            yield Reply(self._shaped(final), final=True)
        else:
            for _ in generation:
                clock.tick()
            result = generation.result
            exclude = self.exclude_input_in_output if request.exclude_input_in_output is None else request.exclude_input_in_output
            text = result.text if exclude else request.prompt + result.text
            yield Reply(self._shaped(self._final(generation, text, result.token_ids, request, clock)), final=True)

    def prepared(self, tensors: Mapping[str, np.ndarray]) -> tuple[ServedRequest, SpecGenerator, list[int], GenerationConfig]:
        """A request as this model decodes it: parsed, its generator (its end_id), its prompt's token ids (the chat
        template applied when it asks) and its settings. Bad requests raise UsageError."""
        request = parse_request(tensors)
        generator = self._generator(request.end_id)
        config = self._generation_config(request)
        return request, generator, generator.encode(request.prompt, request.chat), config

    def _shaped(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Without a batch dimension (the llmapi model's max_batch_size 0), [1, ...] outputs lose their first axis."""
        if self.batched:
            return tensors
        return {name: array[0] if array.ndim >= 2 else array for name, array in tensors.items()}

    def _generator(self, end_id: Optional[int]) -> SpecGenerator:
        """TensorRT-LLM's end_id replaces the EOS ids for this request (a cheap wrapper, engines are shared)."""
        deployment = self.deployment
        if end_id is None or end_id < 0:
            return deployment.generator
        if end_id >= deployment.target.vocab_size:
            raise UsageError(f"end_id {end_id} is outside the vocabulary (size {deployment.target.vocab_size})")
        return deployment.generator.with_eos([end_id])

    def _generation_config(self, request: ServedRequest):
        fields = dict(request.config)
        if request.end_id is not None and request.end_id < 0:
            fields["stop_on_eos"] = False  # TensorRT-LLM: end_id -1 generates max_tokens regardless of EOS
        try:
            return self.deployment.generation_config(**fields)
        except ValidationError as exc:
            problems = [f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()]
            raise UsageError("bad generation settings: " + "; ".join(problems)) from None

    def _tensors(self, text: str, token_ids: list[int], request: ServedRequest, generation: Generation, clock: "_Clock"):
        tensors = {
            # [batch * beams] = [1], as tensorrtllm_backend's postprocessing model returns it (clients index [0])
            "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
            "token_ids": np.array([token_ids], dtype=np.int32).reshape(1, len(token_ids)),
            "batch_index": np.zeros((1, 1), np.int32),
            "sequence_index": np.zeros((1, 1), np.int32),
        }
        if request.return_perf_metrics:
            stats = generation.stats
            tensors.update(
                kv_cache_alloc_new_blocks=np.zeros((1, 1), np.int32),
                kv_cache_reused_blocks=np.zeros((1, 1), np.int32),
                kv_cache_alloc_total_blocks=np.zeros((1, 1), np.int32),
                arrival_time_ns=np.array([[clock.arrival_ns]], np.int64),
                first_scheduled_time_ns=np.array([[clock.arrival_ns]], np.int64),
                first_token_time_ns=np.array([[clock.first_ns or 0]], np.int64),
                last_token_time_ns=np.array([[clock.last_ns or 0]], np.int64),
                acceptance_rate=np.array([[stats.acceptance_rate]], np.float32),
                total_accepted_draft_tokens=np.array([[stats.accepted]], np.int32),
                total_draft_tokens=np.array([[stats.drafted]], np.int32),
            )
        return tensors

    def _final(self, generation: Generation, text, token_ids, request, clock) -> dict[str, np.ndarray]:
        tensors = self._tensors(text, token_ids, request, generation, clock)
        stats = {k: v for k, v in generation.result.as_dict().items() if k not in ("text", "token_ids")}
        tensors["stats_json"] = np.array([[json.dumps(stats).encode()]], dtype=np.object_)
        if request.return_finish_reason:
            reason = LLMAPI_FINISH_REASON[generation.result.finish_reason]
            tensors["finish_reason"] = np.array([[reason.encode()]], dtype=np.object_)
        return tensors


class _Clock:
    """Wall-clock times of a request, in ns since the epoch (TensorRT-LLM's perf-metric outputs)."""

    def __init__(self, arrival_ns: int):
        self.arrival_ns = arrival_ns
        self.first_ns: Optional[int] = None
        self.last_ns: Optional[int] = None

    def tick(self) -> None:
        self.last_ns = time.time_ns()
        self.first_ns = self.first_ns or self.last_ns
