"""Speculative decoding: drafters, the acceptance rule, the decoding loop, and the text layer."""

from specpipe.spec.adaptive import AdaptiveDraftLength, DraftLengthPolicy, FixedDraftLength
from specpipe.spec.decoder import SpeculativeDecoder
from specpipe.spec.drafters import Drafter, DraftSession, ModelDrafter, Proposal
from specpipe.spec.generator import Chunk, Generation, Result, SpecGenerator
from specpipe.spec.ngram import NgramDrafter
from specpipe.spec.stats import SpecStats
from specpipe.spec.verify import Verdict, verify_greedy, verify_sampled

__all__ = [
    "Chunk", "Drafter", "DraftSession", "Generation", "ModelDrafter", "Proposal", "Result",
    "SpecGenerator", "SpecStats", "SpeculativeDecoder", "Verdict", "verify_greedy", "verify_sampled",
    "AdaptiveDraftLength", "DraftLengthPolicy", "FixedDraftLength", "NgramDrafter",
]
