"""The peer line: Hugging Face transformers' own assisted generation on the same pair's torch checkpoints.

`model.generate(assistant_model=draft)` is transformers' speculative decoding (with its default
draft-length heuristics), run eagerly in torch; its target-only `generate` is shown beside it so the
peer's own speedup can be read too. Greedy, same prompt ids, same token limit, same threads.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Optional

from specpipe.bench.harness import Measurement
from specpipe.manifest import Manifest


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


class HFRow:
    """transformers generate(): target alone (`assistant=None`) or assisted by the draft."""

    def __init__(self, label: str, target, assistant=None, eos_token_ids: Optional[list[int]] = None):
        self.label, self.target, self.assistant = label, target, assistant
        self.kind, self.k = "peer", None
        self.eos_token_ids = eos_token_ids
        # transformers keeps the assistant's adaptive state (K, confidence threshold) across calls:
        # restore its initial generation config before each prompt so prompts are independent.
        self._assistant_config = copy.deepcopy(assistant.generation_config) if assistant is not None else None

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> Measurement:
        import torch

        if self.assistant is not None:
            self.assistant.generation_config = copy.deepcopy(self._assistant_config)
        input_ids = torch.tensor([prompt_ids], dtype=torch.long)
        clock = _FirstTokenClock()
        extra = {"assistant_model": self.assistant} if self.assistant is not None else {}
        start = time.perf_counter()
        with torch.inference_mode():
            output = self.target.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=self.eos_token_ids, pad_token_id=(self.eos_token_ids or [0])[0], streamer=clock, **extra,
            )
        total_ms = (time.perf_counter() - start) * 1e3
        new_ids = output[0, len(prompt_ids) :].tolist()
        ttft_ms = (clock.first_token_at - start) * 1e3 if clock.first_token_at else total_ms
        return Measurement(prompt_id="", num_generated=len(new_ids), total_ms=total_ms, ttft_ms=ttft_ms, token_ids=new_ids)


def peer_rows(manifest: Manifest, threads: int) -> tuple[list[HFRow], Optional[str]]:
    """The peer rows for a deployment, from the torch checkpoints its manifest names; ([], reason) when
    they cannot be loaded (a draft that is not a model, checkpoints moved away)."""
    import torch

    from specpipe.checkpoint import load_causal_lm

    if manifest.draft.kind != "model":
        return [], f"draft kind {manifest.draft.kind!r} has no torch checkpoint"
    paths = [manifest.target.resolved_path, manifest.draft.resolved_path]
    if not all(paths) or not all(Path(p).is_dir() for p in paths):
        return [], f"torch checkpoints not found ({', '.join(str(p) for p in paths)})"
    torch.set_num_threads(threads)
    target = load_causal_lm(Path(paths[0]))
    assistant = load_causal_lm(Path(paths[1]))  # its own object even when the paths match: it keeps its own cache
    return [HFRow("hf target-only", target, None, manifest.eos_token_ids),
            HFRow("hf assisted", target, assistant, manifest.eos_token_ids)], None
