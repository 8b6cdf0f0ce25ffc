"""The repository's own model.py, run outside a server: `triton_python_backend_utils` (only the Python backend's
stub has it) is replaced by a stand-in, and the model is initialized as Triton does (its config.pbtxt as JSON) on
the deployment beside it. Its target's workers block instead of spinning; it asks whether a client went away at
most once per CANCELLATION_CHECK_PERIOD_S, and a request whose client left frees its row."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from specpipe.triton.profile import PROFILE_ENV

SPINNING = "session.intra_op.allow_spinning"


def _fake_backend_utils() -> types.SimpleNamespace:
    class MetricFamily:
        COUNTER = "counter"

        def __init__(self, name, description, kind):
            pass

        def Metric(self, labels):
            return types.SimpleNamespace(increment=lambda value: None)

    return types.SimpleNamespace(
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=1, TritonModelException=RuntimeError, Logger=types.SimpleNamespace(log_error=print),
        MetricFamily=MetricFamily, Tensor=lambda name, array: (name, array), TritonError=str,
        InferenceResponse=lambda output_tensors=(), error=None: {"outputs": dict(output_tensors), "error": error})


@pytest.fixture(scope="module")
def model_dir(tiny_build, tmp_path_factory) -> Path:
    from specpipe.triton.repository import write_repository

    return write_repository(tiny_build, tmp_path_factory.mktemp("repo") / "repo")


@pytest.fixture
def served(model_dir, monkeypatch):
    """model.py's module and its TritonPythonModel, initialized."""
    from google.protobuf import json_format

    import specpipe.triton.stubs
    from specpipe.triton.model_config import read_config

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_backend_utils())
    monkeypatch.setattr(specpipe.triton.stubs, "exit_with_server", lambda: None)  # no server to outlive here
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    # initialize() sets these for the stub's process; here they must not outlive the test (USE_TORCH=0 left in this
    # process's environment broke the builder subprocesses of every later test that builds)
    monkeypatch.setenv("USE_TORCH", "0")
    monkeypatch.setenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    spec = importlib.util.spec_from_file_location("served_model_py", model_dir / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    config = json_format.MessageToJson(read_config(model_dir), preserving_proto_field_name=True)
    model.initialize({"model_config": config, "model_name": model_dir.name, "model_version": "1"})
    return module, model


def test_the_served_model_file_loads_its_target_with_blocking_workers(served, model_dir):
    """A model.py (or triton.serving.load_served) that drops `spinning=False`, or sets True, fails here."""
    _, model = served
    deployment = model.model.deployment
    assert Path(deployment.target.folder).resolve().is_relative_to(model_dir.resolve())
    options = deployment.target.session.get_session_options()
    try:
        spinning = options.get_session_config_entry(SPINNING)
    except Exception:  # not set: ONNX Runtime's default, spinning
        spinning = "default"
    assert model.model.batching and spinning == "0"


class _Sender:
    """A response sender whose client is gone from the `gone_at`-th is_cancelled() on (None: never)."""

    def __init__(self, gone_at=None):
        self.gone_at, self.checks, self.sent = gone_at, 0, []

    def is_cancelled(self) -> bool:
        self.checks += 1
        return self.gone_at is not None and self.checks >= self.gone_at

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))


def _request(sender: _Sender, max_tokens: int):
    tensors = {"text_input": np.array([[b"def add(a, b):"]], dtype=np.object_),
               "max_tokens": np.array([[max_tokens]], dtype=np.int32), "stream": np.array([[True]], dtype=bool),
               "end_id": np.array([[-1]], dtype=np.int32)}
    inputs = [types.SimpleNamespace(name=lambda n=name: n, as_numpy=lambda a=array: a) for name, array in tensors.items()]
    return types.SimpleNamespace(inputs=lambda: inputs, get_response_sender=lambda: sender)


@pytest.mark.timing  # the scheduler's thread makes the tokens
@pytest.mark.parametrize("period_s", [1e9, 0.0])
def test_a_stream_asks_whether_its_client_left_once_a_period(served, monkeypatch, period_s):
    """Each is_cancelled() is a round trip to tritonserver: asked once a period, not before each response (with a
    period of 0, before each: the 12 tokens', the rest of the text's, the final one)."""
    module, model = served
    monkeypatch.setattr(module, "CANCELLATION_CHECK_PERIOD_S", period_s)
    sender = _Sender()
    model._answer_with(_request(sender, 12), None)
    tokens = sum(response["outputs"]["token_ids"].size for response, _ in sender.sent)
    assert tokens == 12 and sender.sent[-1][1] == module.FINAL
    assert sender.checks == (1 if period_s else len(sender.sent)) and len(sender.sent) >= 13


@pytest.mark.timing
def test_a_request_whose_client_left_stops_and_frees_its_row(served, monkeypatch):
    module, model = served
    monkeypatch.setattr(module, "CANCELLATION_CHECK_PERIOD_S", 0.0)
    sender = _Sender(gone_at=3)
    model._answer_with(_request(sender, 400), None)
    assert sender.checks == 3 and len(sender.sent) == 3  # two tokens' responses, then the final one
    assert sender.sent[-1] == (None, module.FINAL)
    scheduler = model.model.deployment.generator.decoder
    freed = threading.Event()
    deadline = time.monotonic() + 60  # the scheduler ends a cancelled request at its next step
    while not freed.wait(0.01) and time.monotonic() < deadline:
        with scheduler._wake:
            if not scheduler.running and not scheduler.waiting:
                freed.set()
    assert freed.is_set()
