"""Write the Triton model repository for a built deployment (engines/<name>/).

Layout (relocatable: nothing refers outside the model folder):

    <repo>/<model>/config.pbtxt      rendered from a ModelSpec (model_config_pb2 + text_format)
    <repo>/<model>/1/model.py        copy of specpipe/triton/model_py/model.py, the Python-backend adapter
    <repo>/<model>/1/engine/...      the deployment: manifest.json, tokenizer/, target/, draft/ (what the
                                     manifest names; hard links on the same filesystem, else copies)

The model is named `ensemble` by default: the model name TensorRT-LLM's Triton clients use.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from specpipe.errors import GateError, OutputExistsError, UsageError
from specpipe.triton.model_config import ModelSpec
from specpipe.triton.protocol import LLMAPI_SERVED_INPUTS, LLMAPI_SERVED_OUTPUTS, MAX_BATCH_SIZE, SERVED_INPUTS, SERVED_OUTPUTS

Protocol = Literal["tensorrtllm_backend", "llmapi"]

MODEL_PY = Path(__file__).parent / "model_py" / "model.py"
DEFAULT_MODEL_NAME = "ensemble"
VERSION = "1"


class ModelParameters(BaseModel):
    """The served model's Triton `parameters` (strings in config.pbtxt), read back by model.py."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine_dir: str = Field("engine", description="the deployment, relative to the version folder")
    engine_threads: int = Field(0, ge=0, description="ONNX Runtime threads per instance; 0 = cores / instances")
    exclude_input_in_output: bool = Field(
        True, description="default when a request does not say: return only the generated text (TensorRT-LLM's key)"
    )
    max_batch_size: int = Field(0, ge=0, description="requests decoded together; 0 = the build's (manifest serving)")
    max_queue: int = Field(-1, ge=-1, description="requests that may wait for a slot, then refused; -1 = the build's")
    stream_interval: int = Field(
        1, ge=1, description="tokens a streamed response gathers before it is sent (the first token goes at once): "
        "fewer, larger responses cut the server's and the clients' cost per token under many streams, at a coarser "
        "stream (TensorRT-LLM's and vLLM's stream_interval)")
    protocol: Protocol = Field(
        "tensorrtllm_backend",
        description="tensor shapes served: tensorrt_llm_bls's (batch dimension) or the llmapi model's (max_batch_size 0)",
    )

    def to_triton(self) -> dict[str, str]:
        return {key: str(value).lower() if isinstance(value, bool) else str(value) for key, value in self}

    @classmethod
    def from_triton(cls, model_config: dict) -> "ModelParameters":
        """From the model_config JSON Triton hands to model.py's initialize()."""
        raw = {key: value["string_value"] for key, value in model_config.get("parameters", {}).items()}
        return cls(**{key: value for key, value in raw.items() if key in cls.model_fields})

    def threads_per_instance(self, instance_count: int, cpu_count: int | None) -> int:
        """Instances run in parallel (one process each), so by default they share the cores evenly."""
        return self.engine_threads or max(1, (cpu_count or 1) // max(1, instance_count))


def served_model_spec(
    name: str = DEFAULT_MODEL_NAME, *, instance_count: int = 1, parameters: ModelParameters | None = None
) -> ModelSpec:
    """The decoupled Python-backend model with tensorrtllm_backend's inputs and outputs, or (parameters.protocol
    "llmapi") with TensorRT-LLM's llmapi model's (see protocol.py)."""
    parameters = parameters or ModelParameters()
    llmapi = parameters.protocol == "llmapi"
    return ModelSpec(
        name=name,
        backend="python",
        max_batch_size=0 if llmapi else MAX_BATCH_SIZE,
        inputs=LLMAPI_SERVED_INPUTS if llmapi else SERVED_INPUTS,
        outputs=LLMAPI_SERVED_OUTPUTS if llmapi else SERVED_OUTPUTS,
        decoupled=True,
        instance_count=instance_count,
        instance_kind="KIND_CPU",
        parameters=parameters.to_triton(),
    )


def write_repository(
    engine_dir: Path,
    repo_dir: Path,
    *,
    instance_count: int = 1,
    model_name: str = DEFAULT_MODEL_NAME,
    engine_threads: int = 0,
    exclude_input_in_output: bool = True,
    force: bool = False,
    protocol: Protocol = "tensorrtllm_backend",
    stream_interval: int = 1,
) -> Path:
    """Write <repo_dir>/<model_name>/ for the deployment in `engine_dir`; returns that model folder.

    Built in a temp folder beside `repo_dir` and renamed into place, so a failure leaves nothing behind
    (and Triton never sees a half-written model). Other models in `repo_dir` are left alone.
    """
    from specpipe.drafts import read_manifest

    engine_dir, repo_dir = Path(engine_dir), Path(repo_dir)
    manifest = read_manifest(engine_dir)  # a clear error now rather than a failed model load in the server
    if not model_name or "/" in model_name or model_name.startswith("."):
        raise UsageError(f"model name must be a plain folder name, got {model_name!r}")
    if instance_count < 1:
        raise UsageError(f"instance count must be >= 1, got {instance_count}")
    final = repo_dir / model_name
    if final.exists() and not force:
        raise OutputExistsError(f"{final} exists; pass --force to replace it")
    spec = served_model_spec(
        model_name,
        instance_count=instance_count,
        parameters=ModelParameters(engine_threads=engine_threads, exclude_input_in_output=exclude_input_in_output,
                                   protocol=protocol, stream_interval=stream_interval),
    )

    repo_dir.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{repo_dir.name}.{model_name}.", dir=repo_dir.resolve().parent))
    try:
        model_dir = stage / model_name
        version_dir = model_dir / VERSION
        deployment = version_dir / spec_engine_dir(spec)
        for relative in manifest.deployment_paths():
            source, copy = engine_dir / relative, deployment / relative
            copy.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, copy, copy_function=_link_or_copy)
            else:
                _link_or_copy(str(source), str(copy))
        shutil.copy2(MODEL_PY, version_dir / "model.py")
        spec.write(model_dir)
        if final.exists():
            old = stage / f"{model_name}.old"
            final.rename(old)
            try:
                model_dir.rename(final)
            except OSError:
                old.rename(final)
                raise
        else:
            model_dir.rename(final)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return final


def spec_engine_dir(spec: ModelSpec) -> str:
    return spec.parameters.get("engine_dir", ModelParameters().engine_dir)


def _link_or_copy(src: str, dst: str) -> None:
    """Hard links cost no space; engines are never modified in place (builds write new files)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def served_engine_dir(repo: Path, model_name: str) -> Path:
    """The deployment a repository's model serves: <repo>/<model>/1/<engine_dir parameter>."""
    from specpipe.triton.model_config import read_config

    model_dir = Path(repo) / model_name
    if not (model_dir / "config.pbtxt").is_file():
        models = sorted(p.name for p in Path(repo).iterdir() if (p / "config.pbtxt").is_file()) if Path(repo).is_dir() else []
        raise GateError(f"{repo} has no model {model_name!r} (models: {', '.join(models) or 'none'}); see --model")
    parameters = {key: value.string_value for key, value in read_config(model_dir).parameters.items()}
    engine_dir = parameters.get("engine_dir", ModelParameters().engine_dir)
    return model_dir / VERSION / engine_dir
