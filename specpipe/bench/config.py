"""`specpipe bench` and `specpipe loadtest`: what to run, on which prompts, beside which peers."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from specpipe.config import THREADS, Strict, Threads
from specpipe.contract.generation import BenchPromptSet


# The engines `bench --peer` can run beside specpipe's own (specpipe/bench/peers): transformers, OpenVINO GenAI,
# onnxruntime-genai, llama.cpp (llama-cpp-python). All but hf come from the `peers` extra.
PeerName = Literal["hf", "openvino", "ortgenai", "llamacpp"]


class BenchConfig(Strict):
    """`specpipe bench`: target-only, speculative K=1..8 (and adaptive K), and the peers (transformers,
    OpenVINO GenAI, onnxruntime-genai, llama.cpp) on the same pair, prompts and settings, in one run."""

    engine_dir: Path
    prompts: list[Path] = Field(default_factory=list, description="JSONL prompt files ({\"prompt\": ...} per line)")
    prompt_sets: list[BenchPromptSet] = Field(
        default_factory=list, description="packaged prompt sets; code and chat when neither these nor --prompts are given"
    )
    draft_lengths: list[int] = Field(default_factory=lambda: list(range(1, 9)), min_length=1,
                                     description="fixed K values to run")
    adaptive: bool = Field(True, description="also run the default adaptive draft length")
    head: Optional[Path] = Field(None, description="an EAGLE-3 head folder that drafts instead of the deployment's "
                                 "draft (the target engine must output the head's feature layers)")
    peers: list[PeerName] = Field(
        default_factory=lambda: ["hf"],
        description="other engines to run on the same pair, prompts and settings: hf, openvino, ortgenai, llamacpp",
    )
    peer_draft_lengths: Optional[list[int]] = Field(
        None, description="fixed K values for the peers' draft-model rows (default: the -k values)"
    )
    max_new_tokens: int = Field(128, ge=1)
    threads: Threads = Field(THREADS, description="threads of every engine: ONNX Runtime intra-op, torch, and each peer's own")
    chat: bool = Field(True, description="apply the tokenizer's chat template to each prompt")
    max_prompts: Optional[int] = Field(None, ge=1, description="use only the first N prompts of each set")
    warmup_prompts: int = Field(1, ge=0, description="untimed runs per row before measuring")
    rounds: int = Field(1, ge=1, description="passes over the prompts, each prompt through every row in each: a "
                        "prompt's speedup is the geometric mean of its rounds', so more rounds average over more of "
                        "the machine's spells (the report adds each round's speedup)")

    @field_validator("draft_lengths", "peer_draft_lengths")
    @classmethod
    def _positive_draft_lengths(cls, v: Optional[list[int]]) -> Optional[list[int]]:
        if v is None:
            return v
        if any(k < 1 for k in v):
            raise ValueError(f"K must be >= 1, got {sorted(v)}")
        return sorted(set(v))

    @field_validator("peers")
    @classmethod
    def _unique_peers(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))


class LoadConfig(Strict):
    """`specpipe loadtest`: closed-loop streaming users against a Triton server, one level per concurrency.

    Requests carry tensorrtllm_backend's tensor names only, so the server decodes with its deployment's own
    settings (greedy, its draft length) unless num_draft_tokens is given."""

    concurrency: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16], min_length=1,
                                   description="users (streams in flight) per level")
    requests: int = Field(32, ge=1, description="measured requests per level")
    requests_per_user: int = Field(0, ge=0, description="at least this many requests per user at each level "
                                                        "(a level runs max(requests, this x users))")
    warmup_requests: int = Field(2, ge=0, description="requests sent first, one at a time, and not measured")
    max_tokens: int = Field(64, ge=1, description="new tokens per request")
    prompt_set: BenchPromptSet = Field("code", description="packaged prompt set the requests cycle through")
    prompts: Optional[Path] = Field(None, description='JSONL prompt file ({"prompt": ...} per line) instead of the set')
    num_draft_tokens: Optional[int] = Field(
        None, ge=0, description="K sent with every request (0 = target only); default: the deployment's own"
    )
    ignore_eos: bool = Field(True, description="generate max_tokens even past EOS (TensorRT-LLM's end_id -1): "
                                               "every row does the same work")
    request_timeout_s: float = Field(600.0, gt=0, description="longest wait for the next response of a request")
    rss_interval_s: float = Field(0.5, gt=0, description="seconds between samples of the server's memory")
    label: Optional[str] = Field(None, description="row name in tables and plots; default: the target's name")
    arrivals: Literal["staggered", "burst"] = Field(
        "staggered", description="staggered: user n starts n/C of a request's latency (the warm-up's) after the "
                                 "level begins, as independent users do; burst: every user at once (equal-length "
                                 "requests then stay in step: every user's next prompt arrives in the same step)")
    perf_metrics: bool = Field(
        False, description="ask for TensorRT-LLM's perf-metric outputs in every response (return_perf_metrics: 10 "
                           "more tensors a streamed token for the server to build and send and the clients to read; "
                           "off in TensorRT-LLM by default, and the loadtest reads none of them)")
    stream_interval: Optional[int] = Field(
        None, ge=1, description="tokens a streamed response gathers (the Triton model's stream_interval) in the "
                                "repository written for TARGET engines/NAME; default: the build's default (1); a "
                                "repository's own config.pbtxt sets it there")
    engine_alone: bool = Field(
        True, description="after each level, time the served engine alone in this process (TARGET only), on the "
                          "level's first prompts: its batched decode rate, and with burst arrivals the burst's "
                          "prefill; the rows get the served share and the burst's TTFT p95 over that prefill")
    against_target_only: bool = Field(
        False, description="run every level twice on the same server, once with K = 0 sent in every request "
                           "(the target alone, batched) and once as deployed, each in two halves in the order "
                           "A B B A so that drift favours neither: two runs, '<label> target-only' and '<label>'")

    @field_validator("concurrency")
    @classmethod
    def _positive_levels(cls, v: list[int]) -> list[int]:
        if any(c < 1 for c in v):
            raise ValueError(f"every level needs >= 1 user, got {v}")
        return sorted(set(v))

    @model_validator(mode="after")
    def _every_user_sends(self) -> "LoadConfig":
        if max(self.requests, self.requests_per_user * max(self.concurrency)) < max(self.concurrency):
            raise ValueError(f"requests {self.requests} < concurrency {max(self.concurrency)}: some users would send nothing")
        if self.against_target_only and self.num_draft_tokens is not None:
            raise ValueError("against_target_only sends K = 0 and the deployment's own K: num_draft_tokens would "
                             "override the second")
        return self

    def requests_at(self, concurrency: int) -> int:
        return max(self.requests, self.requests_per_user * concurrency)


class SoakConfig(Strict):
    """`make soak` (bench/soak.py): many closed-loop streaming users through the real server, each request one of
    a mix of lengths and sampling settings. Passes with 0 errors, server memory growth under `rss_growth_limit`,
    and every greedy output equal to the same request decoded alone (the near-tie rule)."""

    streams: int = Field(16, ge=1, description="users, each with one request in flight")
    requests_per_stream: int = Field(100, ge=1, description="requests each user sends, one after another")
    max_tokens: list[int] = Field(default_factory=lambda: [8, 24, 64], min_length=1,
                                  description="new-token limits the requests cycle through (mixed lengths)")
    prompt_set: BenchPromptSet = Field("code", description="packaged prompt set the requests cycle through")
    rss_growth_limit: float = Field(0.05, gt=0, description="largest allowed growth of the server's memory from "
                                                            "the baseline to the end (0.05 = 5%)")
    rss_baseline_after: float = Field(0.2, ge=0, lt=1, description="share of the soak's requests done when the "
                                      "memory baseline is taken: the arenas grow over the first few hundred "
                                      "requests of a mix and flatten; a leak keeps growing")
    request_timeout_s: float = Field(600.0, gt=0, description="longest wait for the next response of a request")
    threads: Threads = Field(THREADS, description="threads of the in-process engines that decode each greedy "
                                                  "request alone (the reference)")
