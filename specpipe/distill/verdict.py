"""The one-line verdict that ends `distill`: will this draft make decoding faster on this machine?

Held-out agreement is the greedy acceptance rate a K=1 draft would see on unseen prompts; with the step
costs of the two models measured here, the adaptive-K model (speculative/adaptive.py: Leviathan et al.,
Theorem 3.8, plus a per-verified-token cost) predicts the speedup. The costs are torch's fp32 steps;
`build` measures the engines it builds (quantized, head sliced) and records those, usually cheaper drafts.
"""

from __future__ import annotations

import statistics
import time

import torch

from specpipe.contract.costs import StepCosts
from specpipe.speculative.adaptive import best_draft_length, expected_speedup

CONTEXT_TOKENS = 64
VERIFY_TOKENS = 8
MAX_DRAFT_LEN = 16
REPEATS = 7


@torch.inference_mode()
def _step_ms(model, tokens: int) -> float:
    """Median time of one call scoring `tokens` new tokens on a CONTEXT_TOKENS-token KV cache."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    context = torch.randint(0, vocab, (1, CONTEXT_TOKENS), generator=torch.Generator().manual_seed(0)).to(device)
    cache = model(input_ids=context, use_cache=True).past_key_values
    new = context[:, :tokens]
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        model(input_ids=new, past_key_values=cache, use_cache=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
        cache.crop(CONTEXT_TOKENS)
    return statistics.median(times[1:])


def measure_costs(target, draft) -> StepCosts:
    one = _step_ms(target, 1)
    many = _step_ms(target, 1 + VERIFY_TOKENS)
    return StepCosts(draft=_step_ms(draft, 1) / one, verify_per_token=max(many - one, 0.0) / VERIFY_TOKENS / one)


def verdict(agreement: float, costs: StepCosts) -> dict:
    """agreement: the draft's greedy agreement with the target, standing in for the acceptance rate."""
    k = best_draft_length(agreement, costs, MAX_DRAFT_LEN)
    return {"agreement": round(agreement, 4), "step_costs": {k_: round(v, 4) for k_, v in costs.as_dict().items()},
            "best_k": k, "predicted_speedup": round(expected_speedup(k, agreement, costs), 3),
            "measured_with": "torch steps of both models on this machine (build measures the engines)"}


def verdict_line(v: dict) -> str:
    speedup = v["predicted_speedup"]
    costs = v["step_costs"]
    line = (f"verdict: agreement {v['agreement']:.2f} on {v.get('agreement_on', 'held-out answers')}, predicted {speedup:.2f}x at K={v['best_k']} "
            f"(draft step {costs['draft']:.3f}, verify {costs['verify_per_token']:.3f}/token of a target step)")
    if speedup < 1.0:
        line += ": slower than the target alone here; build will prefer another draft or none"
    return line
