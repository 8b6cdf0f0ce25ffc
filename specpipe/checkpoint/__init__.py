"""Checkpoints: resolve what the user names to a local HF folder, load it safely, describe it,
and check that a draft can serve a target.

    resolve_checkpoint("smollm2-135m")      -> ResolvedCheckpoint (folder, kind, weights hash)
    load_causal_lm(path) / load_tokenizer(path)
    inspect_checkpoint(path)                -> CheckpointInfo (recorded in the manifest)
    resolve_shape("llama-70b")              -> ModelShape (an alias's or a folder's architecture numbers)
    check_pair(target_path, draft_path)     -> PairReport, or IncompatiblePairError listing every problem
"""

from specpipe.checkpoint.cache import cache_dir, weights_sha256
from specpipe.checkpoint.facts import ModelFacts, ModelShape, aliases, get_alias, resolve_shape
from specpipe.checkpoint.gguf_convert import convert_gguf
from specpipe.checkpoint.info import CheckpointInfo, inspect_checkpoint
from specpipe.checkpoint.load import is_causal_lm, load_causal_lm, load_tokenizer, tokenizer_hash
from specpipe.checkpoint.pair import PairReport, check_facts_pair, check_pair
from specpipe.checkpoint.resolve import ResolvedCheckpoint, resolve_checkpoint

__all__ = [
    "CheckpointInfo",
    "ModelFacts",
    "ModelShape",
    "PairReport",
    "ResolvedCheckpoint",
    "aliases",
    "cache_dir",
    "check_facts_pair",
    "check_pair",
    "convert_gguf",
    "get_alias",
    "inspect_checkpoint",
    "is_causal_lm",
    "load_causal_lm",
    "load_tokenizer",
    "resolve_checkpoint",
    "resolve_shape",
    "tokenizer_hash",
    "weights_sha256",
]
