"""Can this draft serve this target? Checked before any build, every problem reported at once.

Speculative decoding compares draft and target distributions token by token, so both must give
every id the same meaning: the same token->id mapping and the same BOS/EOS/PAD. Their logit
widths (config.vocab_size) may differ only by padding rows that no token maps to, as in Qwen2.5
(151936 vs 152064 rows for one 151665-id tokenizer); the decoder then compares the first
`shared_vocab_size` logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict

from specpipe.checkpoint.load import architecture_of, is_causal_lm, load_config, load_tokenizer, tokenizer_hash
from specpipe.checkpoint.facts import ModelFacts
from specpipe.errors import IncompatiblePairError

_SPECIAL_TOKENS = ("bos", "eos", "pad")


class PairReport(BaseModel):
    """A compatible pair. Ids below `tokenizer_vocab_size` are tokens; rows from there up are padding."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str
    draft: str
    tokenizer_hash: Optional[str]  # None for an offline check of registry facts
    tokenizer_family: Optional[str]  # registry family name; None for a check of real checkpoints
    tokenizer_vocab_size: int  # highest token id + 1
    target_vocab_size: int
    draft_vocab_size: int
    shared_vocab_size: int  # min of the two logit widths
    padded: bool  # the logit widths differ (by padding rows only)
    special_token_ids: dict[str, Optional[int]]


def check_pair(target_path: Path, draft_path: Path) -> PairReport:
    """Compare two checkpoint folders; raise IncompatiblePairError listing every problem found."""
    configs = {"target": load_config(Path(target_path)), "draft": load_config(Path(draft_path))}
    tokenizers = {"target": load_tokenizer(Path(target_path)), "draft": load_tokenizer(Path(draft_path))}
    vocabs = {role: tok.get_vocab() for role, tok in tokenizers.items()}
    problems: list[str] = []

    for role, config in configs.items():
        if not is_causal_lm(config):
            problems.append(f"the {role} is not a causal LM ({architecture_of(config)})")

    differing = _count_differing_tokens(vocabs["target"], vocabs["draft"])
    if differing:
        problems.append(
            f"tokenizers differ: {differing} tokens map to different ids or exist on one side only"
            f" (target has {len(vocabs['target'])} tokens, draft {len(vocabs['draft'])})"
        )

    for name in _SPECIAL_TOKENS:
        target_tok, draft_tok = (_special(tokenizers[role], name) for role in ("target", "draft"))
        if target_tok != draft_tok:
            problems.append(f"{name.upper()} differs: target {_show(target_tok)} vs draft {_show(draft_tok)}")

    widths = {role: int(config.vocab_size) for role, config in configs.items()}
    spans = {role: max(vocab.values()) + 1 for role, vocab in vocabs.items()}
    problems += _vocab_width_problems(widths, spans, same_tokenizer=not differing)
    if problems:
        raise IncompatiblePairError(problems)

    return PairReport(
        target=str(target_path),
        draft=str(draft_path),
        tokenizer_hash=tokenizer_hash(tokenizers["target"]),
        tokenizer_family=None,
        tokenizer_vocab_size=spans["target"],
        target_vocab_size=widths["target"],
        draft_vocab_size=widths["draft"],
        shared_vocab_size=min(widths.values()),
        padded=widths["target"] != widths["draft"],
        special_token_ids={name: getattr(tokenizers["target"], f"{name}_token_id") for name in _SPECIAL_TOKENS},
    )


def check_facts_pair(target: ModelFacts, draft: ModelFacts) -> PairReport:
    """The same check from registry facts alone (offline plans for models too big to download here)."""
    problems: list[str] = []
    for role, facts in (("target", target), ("draft", draft)):
        if not facts.architecture.endswith("ForCausalLM"):
            problems.append(f"the {role} is not a causal LM ({facts.architecture})")
    same_tokenizer = target.tokenizer == draft.tokenizer
    if not same_tokenizer:
        problems.append(f"tokenizers differ: target uses {target.tokenizer!r}, draft {draft.tokenizer!r}")
    widths = {"target": target.vocab, "draft": draft.vocab}
    spans = {"target": target.tokenizer_vocab, "draft": draft.tokenizer_vocab}
    problems += _vocab_width_problems(widths, spans, same_tokenizer=same_tokenizer)
    if problems:
        raise IncompatiblePairError(problems)
    return PairReport(
        target=target.name,
        draft=draft.name,
        tokenizer_hash=None,
        tokenizer_family=target.tokenizer,
        tokenizer_vocab_size=target.tokenizer_vocab,
        target_vocab_size=target.vocab,
        draft_vocab_size=draft.vocab,
        shared_vocab_size=min(widths.values()),
        padded=target.vocab != draft.vocab,
        special_token_ids={},
    )


def _vocab_width_problems(widths: dict[str, int], spans: dict[str, int], *, same_tokenizer: bool) -> list[str]:
    """Logit widths may differ only when one tokenizer is shared and both widths cover all its ids."""
    problems = [
        f"the {role} has {widths[role]} embedding rows but its tokenizer uses ids up to {spans[role] - 1}"
        for role in widths
        if widths[role] < spans[role]
    ]
    if widths["target"] != widths["draft"] and (problems or not same_tokenizer):
        problems.append(f"vocab sizes differ: target {widths['target']} vs draft {widths['draft']}")
    return problems


def _count_differing_tokens(a: dict[str, int], b: dict[str, int]) -> int:
    return sum(1 for token in a.keys() | b.keys() if a.get(token) != b.get(token))


def _special(tokenizer, name: str) -> tuple[Optional[str], Optional[int]]:
    return getattr(tokenizer, f"{name}_token"), getattr(tokenizer, f"{name}_token_id")


def _show(token: tuple[Optional[str], Optional[int]]) -> str:
    text, token_id = token
    return "none" if text is None else f"{text!r} (id {token_id})"
