"""The hf peer: Hugging Face transformers' own generate() on the pair's torch checkpoints, run eagerly in torch.

Rows: target alone; `assistant_model=draft` at a fixed K (`num_assistant_tokens_schedule="constant"`, no
confidence threshold) and with transformers' default schedule and confidence threshold ("hf assisted",
its adaptive mode); prompt lookup (`prompt_lookup_num_tokens`). Greedy, same prompt ids, same token limit,
same threads.
"""

from __future__ import annotations

import copy
import time
from typing import Optional

from specpipe.bench.harness import Measurement
from specpipe.bench.peers.common import PeerPair, PeerRow

# transformers' documented prompt-lookup setting (its generation docs use 10 tokens; n-gram size default 2).
PROMPT_LOOKUP = {"prompt_lookup_num_tokens": 10}


class _FirstTokenClock:
    """A transformers streamer that notes when the first generated token arrives (the first put() is the prompt)."""

    def __init__(self):
        self.calls = 0
        self.first_token_at: Optional[float] = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


class HFGenerate:
    """target.generate(): alone, assisted by the draft (fixed K or the default schedule), or prompt lookup."""

    def __init__(self, target, eos_token_ids: list[int], assistant=None, k: Optional[int] = None, **extra):
        self.target, self.assistant, self.eos_token_ids, self.extra = target, assistant, eos_token_ids, extra
        self._assistant_config = None
        if assistant is not None:
            config = copy.deepcopy(assistant.generation_config)
            if k is not None:  # exactly K: a constant schedule, and no early stop on a low-confidence draft token
                config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
                config.assistant_confidence_threshold = 0.0
            # transformers keeps the assistant's adaptive state (K, confidence threshold) across calls:
            # restore this initial config before each prompt so prompts are independent.
            self._assistant_config = config

    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> Measurement:
        import torch

        extra = dict(self.extra)
        if self.assistant is not None:
            self.assistant.generation_config = copy.deepcopy(self._assistant_config)
            extra["assistant_model"] = self.assistant
        from transformers.utils import logging as hf_logging

        input_ids = torch.tensor([prompt_ids], dtype=torch.long)
        clock = _FirstTokenClock()
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its adaptive threshold logs every retune: noise under the progress bar
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                output = self.target.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                    do_sample=False, eos_token_id=self.eos_token_ids, pad_token_id=(self.eos_token_ids or [0])[0],
                    streamer=clock, **extra,
                )
        finally:
            hf_logging.set_verbosity(verbosity)
        total_ms = (time.perf_counter() - start) * 1e3
        new_ids = output[0, len(prompt_ids) :].tolist()
        ttft_ms = (clock.first_token_at - start) * 1e3 if clock.first_token_at else total_ms
        return Measurement(prompt_id="", num_generated=len(new_ids), total_ms=total_ms, ttft_ms=ttft_ms, token_ids=new_ids)


def rows(pair: PeerPair) -> tuple[list[PeerRow], list[str]]:
    import torch

    from specpipe.checkpoint import load_causal_lm

    torch.set_num_threads(pair.threads)
    eos = list(pair.eos_token_ids)
    target = load_causal_lm(pair.target_dir)
    precision = "fp32"  # the torch checkpoints as loaded (float32)
    out = [PeerRow("hf target-only", "hf", "target-only", None, precision, HFGenerate(target, eos))]
    if pair.draft_dir is not None:
        assistant = load_causal_lm(pair.draft_dir)  # its own object even when the paths match: it keeps its own cache
        for k in pair.draft_lengths:
            out.append(PeerRow(f"hf K={k}", "hf", "draft-model", k, precision, HFGenerate(target, eos, assistant, k)))
        out.append(PeerRow("hf assisted", "hf", "draft-model", None, precision, HFGenerate(target, eos, assistant)))
    out.append(PeerRow("hf prompt-lookup", "hf", "prompt-lookup", None, precision,
                       HFGenerate(target, eos, **PROMPT_LOOKUP), PROMPT_LOOKUP))
    notes = [] if pair.precision == precision else [f"hf runs the fp32 torch checkpoints, not {pair.precision}"]
    return out, notes
