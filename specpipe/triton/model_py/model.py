"""Triton Python-backend model: specpipe's speculative decoder behind tensorrtllm_backend's tensor names.

A thin adapter. specpipe.triton.serving validates requests and runs specpipe.speculative's SpecGenerator, the
same code `specpipe generate` runs in-process; this file only moves tensors in and responses out.
write_repository() copies it to <repo>/<model>/1/model.py with the engines beside it in 1/engine/, so
the repository can be moved anywhere. The model is decoupled: one response per speculative step.
With continuous batching (the build's max_batch_size > 1), execute() hands each request to a thread of its
own and returns at once; the threads read their tokens from the one scheduler that decodes all running
requests together (specpipe/speculative/batching.py), as vLLM's Triton backend does. A build with
max_batch_size 1 answers one request at a time per instance inside execute(); Triton queues the rest.
"""

import json
import os
import site
import sys
import threading
import time
import traceback
from pathlib import Path

import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# How often a streaming request asks whether its client went away (TensorRT-LLM's cancellation_check_period_ms,
# 100 ms by default). Each sender.is_cancelled() is a round trip to tritonserver, as long as sending a response
# (1.9 ms of wall time each, 16 streams on 2 cores): asked before every token it doubled the messages a token costs.
CANCELLATION_CHECK_PERIOD_S = 0.1

# Prometheus counters on Triton's metrics port; acceptance rate = accepted / drafted.
COUNTERS = {
    "specpipe_requests_total": "Requests answered (successfully)",
    "specpipe_generated_tokens_total": "Tokens generated",
    "specpipe_verify_steps_total": "Target verification steps (one per speculative step)",
    "specpipe_draft_tokens_total": "Tokens proposed by the draft",
    "specpipe_accepted_draft_tokens_total": "Drafted tokens the target accepted",
}
COUNTED_STATS = {  # counter -> field of Result.as_dict()
    "specpipe_generated_tokens_total": "num_generated",
    "specpipe_verify_steps_total": "steps",
    "specpipe_draft_tokens_total": "drafted",
    "specpipe_accepted_draft_tokens_total": "accepted",
}


def _honour_pythonpath():
    """The stub's embedded Python runs with ignore_environment set: PYTHONPATH is in os.environ but not on
    sys.path. `specpipe serve` puts specpipe's own location (and a virtualenv's site-packages) there."""
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[:0] = entries
    for entry in entries:
        site.addsitedir(entry)  # runs .pth files (editable installs) found there


class TritonPythonModel:
    def initialize(self, args):
        _honour_pythonpath()
        from specpipe.triton.stubs import exit_with_server

        exit_with_server()  # a stub that outlives a killed server keeps every engine it loaded in memory
        # The stub only tokenizes with transformers (engines are ONNX Runtime): keeping transformers from
        # importing torch cuts each instance's load from ~7 s to ~1.5 s here. An explicit setting wins.
        os.environ.setdefault("USE_TORCH", "0")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        from specpipe.errors import SpecpipeError
        from specpipe.triton.repository import ModelParameters
        from specpipe.triton.profile import ServedProfile
        from specpipe.triton.serving import ServedModel, load_served

        self.SpecpipeError = SpecpipeError
        config = json.loads(args["model_config"])
        params = ModelParameters.from_triton(config)
        instance_count = sum(group.get("count", 1) for group in config.get("instance_group", [])) or 1
        engine_dir = Path(__file__).parent / params.engine_dir
        try:
            deployment = load_served(engine_dir, params, instance_count)  # its target's workers block, not spin
        except Exception as err:  # one line in Triton's model table and in `specpipe serve`'s error
            raise pb_utils.TritonModelException(f"cannot load {engine_dir}: {type(err).__name__}: {err}") from None
        self.model = ServedModel(
            deployment, exclude_input_in_output=params.exclude_input_in_output, batched=params.protocol != "llmapi",
            stream_interval=params.stream_interval,
        )
        self.profile = ServedProfile.from_env(deployment.generator.decoder)  # None unless SPECPIPE_PROFILE_DIR
        self.logger = pb_utils.Logger
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.metric_families = {
            name: pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.COUNTER)
            for name, text in COUNTERS.items()
        }
        self.counters = {name: family.Metric(labels=labels) for name, family in self.metric_families.items()}
        self.count_lock = threading.Lock()  # answers finish on several threads

    def execute(self, requests):
        for request in requests:
            if self.model.batching:
                threading.Thread(target=self._answer, args=(request,), daemon=True).start()
            else:
                self._answer(request)
        return None  # decoupled: every response goes through the request's sender

    def _answer(self, request):
        profiled = self.profile.answer() if self.profile is not None else None
        cpu0 = time.thread_time()
        try:
            self._answer_with(request, profiled)
        finally:
            if profiled is not None:
                profiled.cpu_s, profiled.end = time.thread_time() - cpu0, time.time()

    def _answer_with(self, request, profiled):
        sender = request.get_response_sender()
        tensors = {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}
        replies = self.model.replies(tensors)
        try:
            next_check = 0.0
            for reply in replies:
                t0 = time.perf_counter()
                if t0 >= next_check:
                    if sender.is_cancelled():
                        replies.close()
                        sender.send(flags=FINAL)
                        return
                    next_check = t0 + CANCELLATION_CHECK_PERIOD_S
                    if profiled is not None:
                        profiled.cancel_check_s += time.perf_counter() - t0
                        profiled.cancel_checks += 1
                    t0 = time.perf_counter()
                outputs = [pb_utils.Tensor(name, array) for name, array in reply.tensors.items()]
                sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=FINAL if reply.final else 0)
                if profiled is not None:
                    profiled.send_s += time.perf_counter() - t0
                    profiled.responses += 1
                    profiled.tokens += reply.tensors["token_ids"].size
                if reply.final:
                    self._count(reply.tensors["stats_json"])
        except self.SpecpipeError as err:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(err))), flags=FINAL)
        except Exception as err:  # a bug, not a bad request: keep the trace in the server log
            self.logger.log_error(traceback.format_exc())
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"internal error: {type(err).__name__}: {err}")),
                        flags=FINAL)

    def finalize(self):
        if getattr(self, "profile", None) is not None:
            self.profile.write()

    def _count(self, stats_json):
        stats = json.loads(stats_json.reshape(-1)[0])
        with self.count_lock:
            self.counters["specpipe_requests_total"].increment(1)
            for counter, field in COUNTED_STATS.items():
                self.counters[counter].increment(float(stats[field]))
