"""The one-line verdict that ends `distill`: will this draft make decoding faster on this machine?

Held-out agreement is the greedy acceptance rate a K=1 draft would see on unseen prompts; with the step
costs of the two models, the adaptive-K model (speculative/adaptive.py: Leviathan et al., Theorem 3.8, plus a
per-verified-token cost) predicts the speedup.

The costs are those of the engines that will run, measured here: the target exported as `build` exports it
(onnxruntime-genai's builder graph) at each target precision the run names (`--verdict-quant`: fp32, int8-wo,
int4-wo, the modes `build --quant` makes, by the same recipes) and timed in ONNX Runtime; an EAGLE-3 head timed as
the CPU engine that drafts with it (engines/eagle3_head.py); a model draft exported and timed like an fp32 target.
torch's own steps misled: a distilled draft measured 0.257 of a target step in torch and 0.019 as the built engine,
so torch predicted 0.98x for a draft that ran at 1.38x. The target's precision matters as much: a quantized target
steps faster while the head's step does not, so the same head that pays against an fp32 target may not against an
int8-wo one (the 2026-11-24 demo: the head 1.00x against the int8-wo target `--quant auto` chose). So the verdict
predicts once per precision and names the least of them. When an engine cannot be made here, the verdict says it
cannot predict and why.

The verify curve is the one decoding pays. Given held-out prompts, the verdict decodes a few of them with the target
alone and with the draft (adaptive K), in turns, and takes each verify call's time over the target alone's 1-token
steps (engines/timing.py `in_decoding_curve`, as the build's sample bench records it). The curve timed alone
(`calls_ms`) read a 2-token call at 1.03 of a step in a fresh Zen 4 demo while decoding paid ~1.2, so that verdict said
1.39x for a head that ran 1.23-1.26x on held-out code (docs/eagle3-decoding.md, session 46).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional, Sequence

from specpipe.contract.costs import StepCosts
from specpipe.speculative.adaptive import best_draft_length, expected_speedup

CONTEXT_TOKENS = 64
VERIFY_TOKENS = 8
MAX_DRAFT_LEN = 16
REPEATS = 40  # rounds of the target's calls in turns (~2 s for SmolLM2-135M on 2 cores)
# Held-out prompts the verdict decodes (each with the target alone and with the draft) and their new tokens:
# ~4 s against an int8-wo SmolLM2-135M, ~10 s against fp32, on 2 cores.
DECODE_PROMPTS = 4
DECODE_TOKENS = 48
MEASURED_WITH = ("ONNX Runtime engines exported here ({quant} target{draft}); build may also quantize a model draft "
                 "and slice its head, which only makes the draft's steps cheaper")
QUANT_NAMES = {"none": "fp32"}  # a target precision as the verdict names it; others by their --quant mode


def export_engine(checkpoint: Path, out: Path, *, feature_layers: Sequence[int] = (), quant: str = "none") -> Path:
    """`checkpoint` as `build` exports a target (the model builder's graph, feature outputs when asked) at `quant`
    (none = fp32, or a weight-only mode by build's own recipe, quantize/weight_only.BUILDER_RECIPES), in `out`,
    ready for engines.load_engine."""
    from specpipe.checkpoint import inspect_checkpoint
    from specpipe.checkpoint.facts import CONTEXT_LENGTH_UNSAID
    from specpipe.config import MAX_SEQ_LEN
    from specpipe.contract.quant import QuantConfig
    from specpipe.engines.onnxruntime import write_engine_meta
    from specpipe.engines.shared_kv import KV_LAYOUT
    from specpipe.export.ortgenai_builder import run_model_builder
    from specpipe.quantize.weight_only import BUILDER_RECIPES

    info = inspect_checkpoint(checkpoint)
    if quant == "none":
        run_model_builder(checkpoint, out, "fp32", out / "cache", feature_layers=list(feature_layers) or None)
    elif quant in BUILDER_RECIPES:
        recipe = BUILDER_RECIPES[quant]
        run_model_builder(checkpoint, out, recipe.precision, out / "cache", feature_layers=list(feature_layers) or None,
                          extra_options=recipe.options(QuantConfig(mode=quant).block_size))
    else:
        raise ValueError(f"the verdict times targets at {', '.join(['none', *BUILDER_RECIPES])}, not {quant}")
    write_engine_meta(out, vocab_size=info.vocab_size, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads,
                      head_dim=info.head_dim, quant=quant, kv_layout=KV_LAYOUT,
                      max_seq_len=min(int(info.max_position_embeddings or CONTEXT_LENGTH_UNSAID), MAX_SEQ_LEN),
                      **({"feature_layers": list(feature_layers)} if feature_layers else {}))
    return out


class ExportedTargets:
    """A target exported as `build` exports it (export_engine), at most once per precision, for one distill run: the
    ONNX teacher answers on one of them and the verdict times them all. The folders live in a temporary folder until
    `close()` (or under `root`, kept)."""

    def __init__(self, checkpoint: Path, feature_layers: Sequence[int] = (), root: Optional[Path] = None):
        self.checkpoint, self.feature_layers = Path(checkpoint), tuple(int(i) for i in feature_layers)
        self._tmp = None if root is not None else tempfile.TemporaryDirectory(prefix="specpipe-targets-")
        self.root = Path(root) if root is not None else Path(self._tmp.name)
        self.folders: dict[str, Path] = {}

    def folder(self, quant: str) -> Path:
        """The engine folder of the target at `quant` (a build --quant mode; none = fp32), exported on first ask."""
        if quant not in self.folders:
            self.folders[quant] = export_engine(self.checkpoint, self.root / f"target-{quant}",
                                                feature_layers=self.feature_layers, quant=quant)
        return self.folders[quant]

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
        self.folders.clear()

    def __enter__(self) -> "ExportedTargets":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def engine_costs(target: Path, *, threads: int, draft: Optional[Path] = None, head: Optional[Path] = None,
                 feature_layers: Sequence[int] = (), quant: str = "none",
                 targets: Optional[ExportedTargets] = None, prompts: Sequence[Sequence[int]] = (),
                 tokenizer=None, eos_token_ids: Sequence[int] = ()) -> tuple[StepCosts, dict]:
    """Step costs, as fractions of a step of the target at `quant`, of the engines that will run: a model `draft`
    checkpoint, or an EAGLE-3 `head` folder reading the target's `feature_layers`. Returns the costs and the
    milliseconds behind them. `targets`: the run's exported targets (exported here when missing). `prompts` (token
    ids, with `tokenizer`): held-out prompts, the first DECODE_PROMPTS decoded with the draft for the verify curve
    (`decoded_costs`); without them, the curve as timed alone."""
    from specpipe.engines import load_engine
    from specpipe.engines.timing import VERIFY_CURVE_TOKENS, calls_ms, curve_of, step_ms

    if targets is not None and (targets.checkpoint != Path(target) or targets.feature_layers != tuple(feature_layers)):
        raise ValueError(f"the exported targets are {targets.checkpoint} with features {list(targets.feature_layers)}, "
                         f"not {target} with {list(feature_layers)}")
    with tempfile.TemporaryDirectory(prefix="specpipe-verdict-") as tmp:
        exported = targets or ExportedTargets(target, feature_layers, root=Path(tmp))
        target_dir = exported.folder(quant)
        engine = load_engine(target_dir, threads=threads)
        # the target's calls in turns (engines/timing.py calls_ms), so the verify curve's ratios come from the same seconds
        ms = calls_ms(engine, [1, *range(2, 2 + VERIFY_CURVE_TOKENS), 1 + VERIFY_TOKENS], context_len=CONTEXT_TOKENS,
                      repeats=REPEATS)
        one, many = ms[1], ms[1 + VERIFY_TOKENS]
        if head is not None:
            from specpipe.drafts.eagle3 import fastest_head_dtype
            from specpipe.engines.eagle3_head import target_embedding

            # the head in the dtype build will run it in: the fastest timed here (drafts/eagle3.py)
            head_dtype, head_ms = fastest_head_dtype(head, target_embedding(target_dir), feature_layers=feature_layers,
                                                    target=engine)
            draft_ms = head_ms[head_dtype]
        else:
            draft_engine = load_engine(export_engine(draft, Path(tmp) / "draft"), threads=threads)
            draft_ms = step_ms(draft_engine, 1, context_len=CONTEXT_TOKENS, repeats=REPEATS)
        curve = curve_of(ms, one)
        costs = StepCosts(draft=draft_ms / one, verify_per_token=max(many - one, 0.0) / VERIFY_TOKENS / one, verify=curve)
        decoded = None
        if prompts and tokenizer is not None:
            if head is not None:
                from specpipe.drafts.eagle3 import head_drafter

                drafter = head_drafter(Path(head), engine, target_dir, dtype=head_dtype)
            else:
                from specpipe.speculative.drafters import ModelDrafter

                drafter = ModelDrafter(draft_engine, engine.vocab_size)
            costs, decoded = decoded_costs(engine, drafter, costs, prompts[:DECODE_PROMPTS], tokenizer, eos_token_ids)
    return costs, {"target_step_ms": round(one, 3), f"target_{1 + VERIFY_TOKENS}_token_step_ms": round(many, 3),
                   "draft_step_ms": round(draft_ms, 3), **({"head_dtype": head_dtype} if head is not None else {}),
                   **({"verify_timed": list(curve), "decoded": decoded} if decoded is not None else {})}


def decoded_costs(engine, drafter, costs: StepCosts, prompts: Sequence[Sequence[int]], tokenizer,
                  eos_token_ids: Sequence[int] = (), *, max_new_tokens: int = DECODE_TOKENS) -> tuple[StepCosts, dict]:
    """`costs` with the verify curve decoding paid: `prompts` decoded greedily by the target alone and with `drafter`
    (adaptive K from `costs`, as served), prompt by prompt in turns (bench/harness.py `run_rows`), each verify call
    over the target alone's 1-token steps (engines/timing.py `in_decoding_curve`: a point with too few calls keeps
    its timed value). Also returns what was decoded: prompts, the calls {tokens: [calls, median ms]} ("1": the
    target alone's), the draft's acceptance and those prompts' speedup (a handful: the prediction stays the model's)."""
    import dataclasses

    from specpipe.bench.harness import SpecRow, run_rows, summarize
    from specpipe.contract.decoding import DecodingPolicy
    from specpipe.engines.timing import in_decoding_curve, pooled_calls
    from specpipe.speculative.generator import SpecGenerator
    from specpipe.speculative.stats import calls_summary

    policy = DecodingPolicy()  # K up to the build's default max_draft_len, greedy: as a built deployment decodes
    rows = [SpecRow("alone", SpecGenerator(engine, None, tokenizer, eos_token_ids, costs), policy.request(0),
                    "target-only", None),
            SpecRow("draft", SpecGenerator(engine, drafter, tokenizer, eos_token_ids, costs), policy.request(None),
                    "speculative", None)]
    listed = [(f"held-out {i}", list(ids)) for i, ids in enumerate(prompts)]
    results = run_rows(rows, listed, max_new_tokens=max_new_tokens, warmup=[listed[0][1]])
    one_token = pooled_calls(results["alone"]).get(1, [])
    calls = pooled_calls(results["draft"])
    curve = in_decoding_curve(one_token, calls, costs.verify)
    summary = summarize("draft", "speculative", None, results["draft"], results["alone"])
    decoded = {"prompts": len(listed), "new_tokens": max_new_tokens, "verify": list(curve),
               "calls": {**calls_summary({1: one_token}), **calls_summary({n: s for n, s in calls.items() if n > 1})},
               "acceptance": summary["acceptance_rate"], "speedup": summary["speedup"]}
    return dataclasses.replace(costs, verify=curve), decoded


def verdict(agreement: float, costs: StepCosts, *, kind: str = "model", timings: Optional[dict] = None,
            quant: str = "none") -> dict:
    """agreement: the draft's greedy agreement with the target, standing in for the acceptance rate."""
    k = best_draft_length(agreement, costs, MAX_DRAFT_LEN)
    draft = (f", the EAGLE-3 head as its CPU engine in {(timings or {}).get('head_dtype', 'its fastest dtype')}"
             if kind == "eagle3" else ", fp32 draft")
    return {"agreement": round(agreement, 4), "target_quant": quant,
            "step_costs": {k_: [round(x, 4) for x in v] if isinstance(v, (tuple, list)) else round(v, 4)
                           for k_, v in costs.as_dict().items()},
            "best_k": k, "predicted_speedup": round(expected_speedup(k, agreement, costs), 3),
            **({"step_ms": timings} if timings else {}),
            "measured_with": MEASURED_WITH.format(quant=QUANT_NAMES.get(quant, quant), draft=draft)}


NOT_TIMED = "not timed here (--no-verdict)"


def no_prediction(agreement: float, reason: str = NOT_TIMED) -> dict:
    """A verdict without a prediction, and why: an engine could not be made, or the run was told not to time engines
    (DistillConfig.verdict off, the default reason)."""
    return {"agreement": round(agreement, 4), "predicted_speedup": None, "cannot_predict": reason}


def measured_verdict(agreement: float, target: Path, *, threads: int, draft: Optional[Path] = None,
                     head: Optional[Path] = None, feature_layers: Sequence[int] = (),
                     quants: Sequence[str] = ("none",), targets: Optional[ExportedTargets] = None,
                     prompts: Sequence[Sequence[int]] = (), tokenizer=None, eos_token_ids: Sequence[int] = ()) -> dict:
    """The verdict with the engines' costs measured here, once per target precision in `quants`: the least
    prediction leads (the build may pick any of them), each one under `by_target_quant`. When an engine cannot be
    made, a verdict that says it cannot predict and why (agreement kept). `targets`: the run's exported targets
    (those the ONNX teacher answered on are not exported again). `prompts`, `tokenizer`, `eos_token_ids`: held-out
    prompts a draft's verify curve is timed on in decoding (`engine_costs`)."""
    from specpipe.errors import SpecpipeError

    by_quant = {}
    for quant in dict.fromkeys(quants):
        try:
            costs, timings = engine_costs(target, threads=threads, draft=draft, head=head, feature_layers=feature_layers,
                                          quant=quant, targets=targets, prompts=prompts, tokenizer=tokenizer,
                                          eos_token_ids=eos_token_ids)
        except (SpecpipeError, OSError, ValueError, RuntimeError) as err:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            return no_prediction(agreement, f"{QUANT_NAMES.get(quant, quant)} target: {reason}")
        by_quant[quant] = verdict(agreement, costs, kind="eagle3" if head is not None else "model", timings=timings,
                                  quant=quant)
    least = min(by_quant.values(), key=lambda v: v["predicted_speedup"])
    return {**least, "by_target_quant": by_quant} if len(by_quant) > 1 else least


def verdict_line(v: dict) -> str:
    if v.get("predicted_speedup") is None:
        return (f"verdict: agreement {v['agreement']:.2f} on {v.get('agreement_on', 'held-out answers')}; cannot predict "
                f"the speedup here ({v.get('cannot_predict', 'no engine costs')}): build measures it")
    speedup = v["predicted_speedup"]
    costs = v["step_costs"]
    target = QUANT_NAMES.get(v.get("target_quant", "none"), v.get("target_quant"))
    decoded = (v.get("step_ms") or {}).get("decoded")
    paid = ""
    if decoded:
        paid = f" as decoding {decoded['prompts']} held-out prompts paid them"
        if decoded.get("speedup") is not None and decoded.get("acceptance") is not None:
            paid += f"; they decoded at {decoded['speedup']:.2f}x, acceptance {decoded['acceptance']:.2f}"

    line = (f"verdict: agreement {v['agreement']:.2f} on {v.get('agreement_on', 'held-out answers')}, predicted {speedup:.2f}x at K={v['best_k']} "
            f"against the {target} target (draft step {costs['draft']:.3f}, verify {_verify_text(costs)} of a target "
            f"step{paid}, ONNX Runtime engines)")
    others = [f"{QUANT_NAMES.get(q, q)} {o['predicted_speedup']:.2f}x" for q, o in (v.get("by_target_quant") or {}).items()
              if q != v.get("target_quant")]
    if others:
        line += "; against " + ", ".join(others)
    if speedup < 1.0:
        line += ": slower than the target alone here; build will prefer another draft or none"
    return line


def _verify_text(costs: dict) -> str:
    """'1+1 tokens 1.08, 1+2 1.25, ...' where the curve was measured (StepCosts.verify), else b per token."""
    curve = costs.get("verify") or []
    if not curve:
        return f"{costs['verify_per_token']:.3f}/token"
    return "calls on 1+k tokens " + ", ".join(f"{v:.2f}" for v in curve[:3]) + " (k = 1, 2, 3)"
