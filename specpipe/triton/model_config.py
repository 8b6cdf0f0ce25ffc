"""A typed Triton model description, rendered to config.pbtxt only through Triton's own protobuf.

`ModelSpec` covers what specpipe's repositories need: a Python-backend model (the CPU repository) and
tensorrtllm_backend's models (preprocessing, tensorrt_llm, tensorrt_llm_bls, postprocessing and the
`ensemble` platform model). `to_proto()` builds a `model_config_pb2.ModelConfig`; `render()` prints it
with `google.protobuf.text_format`, so an unknown field or a misspelt enum fails here, not in the server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from google.protobuf import text_format
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from tritonclient.grpc import model_config_pb2 as mc

CONFIG_FILE = "config.pbtxt"


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorSpec(_Frozen):
    """One input or output. `dims` exclude the batch dimension when the model's max_batch_size > 0."""

    name: str
    data_type: str = Field(description="Triton type without the TYPE_ prefix: STRING, INT32, FP32, BOOL, ...")
    dims: tuple[int, ...]
    optional: bool = False  # inputs only
    reshape: Optional[tuple[int, ...]] = None  # what the model sees; () = a scalar per batch item
    allow_ragged_batch: bool = False  # inputs only

    @field_validator("data_type")
    @classmethod
    def _known_type(cls, v: str) -> str:
        if "TYPE_" + v not in mc.DataType.keys():
            raise ValueError(f"unknown Triton data type {v!r}")
        return v

    def input_proto(self) -> mc.ModelInput:
        proto = mc.ModelInput(
            name=self.name,
            data_type=mc.DataType.Value("TYPE_" + self.data_type),
            dims=list(self.dims),
            optional=self.optional,
            allow_ragged_batch=self.allow_ragged_batch,
        )
        if self.reshape is not None:
            proto.reshape.shape.extend(self.reshape)
            proto.reshape.SetInParent()  # an empty shape (scalar) must still be written
        return proto

    def output_proto(self) -> mc.ModelOutput:
        if self.optional or self.allow_ragged_batch:
            raise ValueError(f"output {self.name!r}: optional / allow_ragged_batch apply to inputs only")
        proto = mc.ModelOutput(name=self.name, data_type=mc.DataType.Value("TYPE_" + self.data_type), dims=list(self.dims))
        if self.reshape is not None:
            proto.reshape.shape.extend(self.reshape)
            proto.reshape.SetInParent()
        return proto


class DynamicBatching(_Frozen):
    preferred_batch_size: tuple[int, ...] = ()
    max_queue_delay_microseconds: int = 0
    max_queue_size: Optional[int] = Field(None, description="requests beyond this are rejected; None = unbounded")


class EnsembleStep(_Frozen):
    """One step of a platform "ensemble" model: a composing model and its tensor wiring."""

    model_name: str
    model_version: int = -1
    input_map: dict[str, str] = Field(default_factory=dict, description="composing model's input -> ensemble tensor")
    output_map: dict[str, str] = Field(default_factory=dict, description="composing model's output -> ensemble tensor")


class ModelSpec(_Frozen):
    """One model of a Triton repository. Exactly one of `backend` ("python", "tensorrtllm") or `platform`
    ("ensemble") is set. `parameters` are Triton's string-valued model parameters."""

    name: str
    backend: Optional[str] = None
    platform: Optional[str] = None
    max_batch_size: int = Field(0, ge=0)
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    decoupled: Optional[bool] = None  # None: leave model_transaction_policy out
    instance_count: Optional[int] = Field(1, ge=1, description="None: no instance_group (ensembles)")
    instance_kind: Literal["KIND_CPU", "KIND_GPU", "KIND_MODEL", "KIND_AUTO"] = "KIND_CPU"
    instance_gpus: tuple[int, ...] = ()
    parameters: dict[str, str] = Field(default_factory=dict)
    dynamic_batching: Optional[DynamicBatching] = None
    ensemble_steps: tuple[EnsembleStep, ...] = ()

    @model_validator(mode="after")
    def _consistent(self) -> "ModelSpec":
        if (self.backend is None) == (self.platform is None):
            raise ValueError(f"model {self.name!r}: set exactly one of backend or platform")
        if bool(self.ensemble_steps) != (self.platform == "ensemble"):
            raise ValueError(f"model {self.name!r}: ensemble_steps go with platform 'ensemble', and only there")
        for kind, tensors in (("input", self.inputs), ("output", self.outputs)):
            names = [t.name for t in tensors]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"model {self.name!r}: duplicate {kind} names {dupes}")
        return self

    def to_proto(self) -> mc.ModelConfig:
        proto = mc.ModelConfig(name=self.name, max_batch_size=self.max_batch_size)
        if self.backend is not None:
            proto.backend = self.backend
        if self.platform is not None:
            proto.platform = self.platform
        proto.input.extend(t.input_proto() for t in self.inputs)
        proto.output.extend(t.output_proto() for t in self.outputs)
        if self.decoupled is not None:
            proto.model_transaction_policy.decoupled = self.decoupled
            proto.model_transaction_policy.SetInParent()
        if self.instance_count is not None:
            proto.instance_group.add(
                count=self.instance_count, kind=mc.ModelInstanceGroup.Kind.Value(self.instance_kind), gpus=self.instance_gpus
            )
        for key, value in self.parameters.items():
            proto.parameters[key].string_value = value
        if self.dynamic_batching is not None:
            batching = proto.dynamic_batching
            batching.SetInParent()
            batching.preferred_batch_size.extend(self.dynamic_batching.preferred_batch_size)
            batching.max_queue_delay_microseconds = self.dynamic_batching.max_queue_delay_microseconds
            if self.dynamic_batching.max_queue_size is not None:
                batching.default_queue_policy.max_queue_size = self.dynamic_batching.max_queue_size
        for step in self.ensemble_steps:
            proto_step = proto.ensemble_scheduling.step.add(model_name=step.model_name, model_version=step.model_version)
            proto_step.input_map.update(step.input_map)
            proto_step.output_map.update(step.output_map)
        return proto

    def render(self) -> str:
        return text_format.MessageToString(self.to_proto())

    def write(self, model_dir: Path) -> Path:
        """Write `model_dir/config.pbtxt` (the folder must be named after the model, as Triton requires)."""
        model_dir = Path(model_dir)
        if model_dir.name != self.name:
            raise ValueError(f"Triton needs model {self.name!r} in a folder of that name, not {model_dir.name!r}")
        model_dir.mkdir(parents=True, exist_ok=True)
        path = model_dir / CONFIG_FILE
        path.write_text(self.render())
        return path


def parse_config(text: str) -> mc.ModelConfig:
    """Parse config.pbtxt text with Triton's schema (raises text_format.ParseError on anything unknown)."""
    return text_format.Parse(text, mc.ModelConfig())


def read_config(model_dir: Path) -> mc.ModelConfig:
    return parse_config((Path(model_dir) / CONFIG_FILE).read_text())
