"""Which precision `build --quant auto` deploys the target at: chosen by measurement, for the load it will serve.

The build makes the target in fp32 and as each of AUTO_QUANT_CANDIDATES (contract/quant.py), scores each
quantized engine against fp32 with the accuracy check (quantize/accuracy.py: perplexity, top-1 agreement), and
times every one on this machine at 1, 2, 4, ... --max-batch-size rows (builder/measure.py `measure_precisions`).
The rule (`choose`, a pure function of those numbers):

1. Only precisions within the accuracy budget take part; fp32 always does (it is the reference).
2. Goodput at n rows = n tokens per batched one-token step of n rows: n * 1000 / ms. The server is built for
   `load_rows` concurrent requests (--max-batch-size, its full load: where its throughput is what runs out);
   the precision with the most goodput there wins.
3. Precisions within LOAD_TIE of that best are tied at full load; one-stream goodput (1 row) breaks the tie:
   one that serves a full server as well and a lone user faster is the better one. Exact ties keep the
   earlier candidate (fp32 first: the most accurate).

So with --max-batch-size 1 the choice is one-stream speed. Measured examples: on a Zen 4 CPU with VNNI, int8-wo
decodes one row 2.4x and 16 rows 1.3x as fast as fp32: int8-wo. On an AVX2 CPU without VNNI, int8-wo decodes one
row ~2x as fast but 16 rows at 0.84x: fp32 for a 16-request server, int8-wo for --max-batch-size 1.
Prefill is left out: it costs about the same share of a step at every precision. Speculation is left out too: at
full load the batch planner turns it off, so the rule's goodput is what runs there. At one stream it is not the
same at every precision: a draft pays more against a slower target (AVX2 Zen 3, session 31, one head on the 12
held-out code prompts: 1.43x against fp32, 42.4 tokens/s; 1.07x against int8-wo, 79.9, where int8-wo alone ran 74.8),
so a target deployed for its full-load goodput may serve one stream slower with its draft than another precision
alone (docs/quantization.md). The draft is chosen after the precision (builder/draft_choice.py).
"""

from __future__ import annotations

from typing import Sequence

from specpipe.contract.manifest import QuantCandidate

LOAD_TIE = 0.05  # goodputs this close at full load are within this machine's run-to-run noise (docs/batching.md)


def choose(candidates: Sequence[QuantCandidate], load_rows: int) -> tuple[str, str]:
    """(the mode to deploy, why), by the module docstring's rule. `candidates` carry their `decode_ms`;
    the unquantized engine ("none") is among them."""
    eligible = [c for c in candidates if c.within_budget and c.decode_ms]
    if not eligible:
        raise ValueError("no precision within the accuracy budget was timed (fp32 always should be)")
    full = {c.mode: c.tokens_per_s(load_rows) for c in eligible}
    best_full = max(full.values())
    tied = [c for c in eligible if full[c.mode] >= best_full * (1 - LOAD_TIE)]
    chosen = max(tied, key=lambda c: c.tokens_per_s(1))  # max keeps the first of equals
    reference = next((c for c in candidates if c.mode == "none" and c.decode_ms), chosen)

    def against_fp32(rows: int) -> str:
        return "" if chosen is reference else f", {chosen.tokens_per_s(rows) / reference.tokens_per_s(rows):.2f}x fp32"

    load = "one request at a time (--max-batch-size 1)" if load_rows == 1 else f"{load_rows} requests (--max-batch-size)"
    reason = f"{name(chosen.mode)} decodes the most tokens/s at the server's full load, {load}: {full[chosen.mode]:.1f} tok/s{against_fp32(load_rows)}"
    if load_rows > 1:
        reason += f"; one stream {chosen.tokens_per_s(1):.1f} tok/s{against_fp32(1)}"
    others = [c for c in tied if c is not chosen]
    if others:
        reason += (f"; {', '.join(name(c.mode) for c in others)} within {LOAD_TIE:.0%} at full load, slower alone")
    alone = max(eligible, key=lambda c: c.tokens_per_s(1))
    if load_rows > 1 and alone.tokens_per_s(1) > chosen.tokens_per_s(1):  # the trade the full load made, said
        reason += (f"; {name(alone.mode)} is faster for one stream ({alone.tokens_per_s(1):.1f} tok/s, "
                   f"{alone.tokens_per_s(1) / chosen.tokens_per_s(1):.2f}x) and {full[alone.mode] / best_full:.2f}x "
                   f"at full load")
    over = [name(c.mode) for c in candidates if not c.within_budget]
    if over:
        reason += f"; over the accuracy budget: {', '.join(over)}"
    return chosen.mode, reason


def name(mode: str) -> str:
    """How a precision is called in the build's output: the unquantized engine is fp32."""
    return "fp32" if mode == "none" else mode
