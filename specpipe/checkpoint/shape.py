"""The architecture numbers a build plan needs, from the alias registry or a checkpoint's config.json.

No weights are read: a plan for Llama 2 70B must work on a laptop. Aliases carry the published values
(specpipe/checkpoint/aliases.toml); a local folder's config.json gives the same fields for a draft that
exists only on disk (a distilled SmolLM2 draft, for example).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from specpipe.errors import UsageError

CONTEXT_LENGTH_UNSAID = 2048  # a config.json without max_position_embeddings (transformers' LlamaConfig default)


class ModelShape(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: str = Field(description="what the user named: an alias or a path")
    hub_id: Optional[str] = None
    tokenizer: Optional[str] = Field(None, description="tokenizer family (aliases only)")
    architecture: str
    params: int = Field(gt=0)
    layers: int = Field(gt=0)
    hidden: int = Field(gt=0)
    intermediate: int = Field(gt=0)
    heads: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab: int = Field(gt=0)
    context_length: int = Field(gt=0)
    tie_word_embeddings: bool

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden


def resolve_shape(spec: str) -> ModelShape:
    """An alias from the registry, or a local HF checkpoint folder (its config.json)."""
    from specpipe.checkpoint.registry import get_alias

    facts = get_alias(spec)
    if facts is not None:
        return ModelShape(
            spec=spec, hub_id=facts.hub_id, tokenizer=facts.tokenizer, architecture=facts.architecture,
            params=facts.params, layers=facts.layers, hidden=facts.hidden, intermediate=facts.intermediate,
            heads=facts.heads, kv_heads=facts.kv_heads, head_dim=facts.head_dim, vocab=facts.vocab,
            context_length=facts.context_length, tie_word_embeddings=facts.tie_word_embeddings,
        )  # fmt: skip
    config_path = Path(spec) / "config.json"
    if not config_path.is_file():
        raise UsageError(f"{spec} is neither a known alias nor a checkpoint folder with a config.json")
    return shape_from_config(json.loads(config_path.read_text()), spec=spec)


def shape_from_config(config: dict, *, spec: str) -> ModelShape:
    """Llama-style decoder numbers from a Hugging Face config.json dict."""
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        intermediate = int(config["intermediate_size"])
        vocab = int(config["vocab_size"])
    except KeyError as missing:
        raise UsageError(f"{spec}/config.json has no {missing}: not a decoder-only transformer specpipe can plan") from None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    tied = bool(config.get("tie_word_embeddings", False))
    return ModelShape(
        spec=spec,
        architecture=(config.get("architectures") or ["unknown"])[0],
        params=llama_params(layers, hidden, intermediate, heads, kv_heads, head_dim, vocab, tied),
        layers=layers, hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, vocab=vocab, context_length=int(config.get("max_position_embeddings") or CONTEXT_LENGTH_UNSAID),
        tie_word_embeddings=tied,
    )  # fmt: skip


def llama_params(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, vocab: int, tied: bool) -> int:
    """Parameter count of a Llama decoder: q/o [H, heads*hd], k/v [H, kv*hd], gate/up/down, two RMSNorms."""
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * intermediate
    per_layer = attention + mlp + 2 * hidden
    embeddings = vocab * hidden * (1 if tied else 2)
    return layers * per_layer + hidden + embeddings
