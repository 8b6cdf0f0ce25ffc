"""Speculative decoding: drafters, the acceptance rule, the decoding loop, and the text layer."""

from specpipe.speculative.adaptive import AdaptiveDraftLength, DraftLengthPolicy, FixedDraftLength
from specpipe.speculative.decoder import SpeculativeDecoder
from specpipe.speculative.drafters import Drafter, DraftSession, ModelDrafter, Proposal
from specpipe.speculative.generator import Chunk, Generation, Result, SpecGenerator
from specpipe.speculative.ngram import NgramDrafter
from specpipe.speculative.stats import SpecStats
from specpipe.speculative.verify import Verdict, verify_greedy, verify_sampled

__all__ = [
    "Chunk", "Drafter", "DraftSession", "Generation", "ModelDrafter", "Proposal", "Result",
    "SpecGenerator", "SpecStats", "SpeculativeDecoder", "Verdict", "verify_greedy", "verify_sampled",
    "AdaptiveDraftLength", "DraftLengthPolicy", "FixedDraftLength", "NgramDrafter",
]
