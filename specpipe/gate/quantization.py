"""Check 3, quantization accuracy within budget.

The numbers come from the manifest: for each quantized engine the build records the "quant" block that
specpipe.quantize.quantize_engine returns (accuracy: perplexity change, top-1 agreement, mean KL against
the unquantized engine of the same model; and the budget it was held to). With --remeasure they are
measured again now (specpipe.quantize.measure_accuracy), which needs the unquantized engine the build kept.

Budgets: the gate file's [quantization] keys override the recorded budget key by key. The target's
accuracy decides the check; the draft's never changes an output (speculative decoding is lossless), only
how often drafts are accepted, so a draft over budget is a warning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from specpipe.contract.manifest import Manifest, ModelEntry
from specpipe.drafts.self_draft import SelfDraft
from specpipe.contract.quant import AccuracyBudget
from specpipe.errors import GateError
from specpipe.gate.config import GateConfig
from specpipe.gate.report import CheckResult

NAME = "quantization_accuracy"

Built = Union[ModelEntry, SelfDraft]  # a model with an engine of its own: the target, a draft model, a self-draft


def _built_engines(manifest: Manifest) -> list[tuple[str, Built]]:
    """(role, entry) of each engine the build made; prompt lookup and no draft have none."""
    draft = [("draft", manifest.draft)] if isinstance(manifest.draft, (ModelEntry, SelfDraft)) else []
    return [("target", manifest.target), *draft]


def check_quantization(manifest: Manifest, folder: Path, gate: GateConfig, *, remeasure: bool = False) -> CheckResult:
    from specpipe.quantize.accuracy import budget_violations

    roles = _built_engines(manifest)
    modes = {role: entry.quant_mode for role, entry in roles}
    quantized = [(role, entry) for role, entry in roles if modes[role] != "none"]
    if not quantized:
        summary = "not applicable: no quantized engine in the manifest (" + ", ".join(f"{r} {m}" for r, m in modes.items()) + ")"
        return CheckResult(NAME, "passed", summary, metrics={"applicable": False, "modes": modes})

    failures, warnings, per_engine = [], [], {}
    for role, entry in quantized:
        budget = _budget(entry.quant.budget if entry.quant else None, gate)
        if remeasure:
            report = _remeasure(folder, role, entry, manifest)
        elif entry.quant is not None and entry.quant.accuracy is not None:
            report = entry.quant.accuracy
        else:
            failures.append(f"{role} ({modes[role]}): the manifest records no accuracy numbers; rebuild or use --remeasure")
            continue
        violations = budget_violations(report, budget)
        per_engine[role] = {
            "mode": modes[role], "accuracy": report.as_dict(), "budget": budget.model_dump(),
            "remeasured": remeasure, "violations": [v.as_dict() for v in violations],
        }
        for v in violations:
            message = f"{role} ({modes[role]}): {v.metric} = {v.value:.4g}, limit {v.limit:.4g}"
            (failures if role == "target" else warnings).append(message)
    status = "failed" if failures else "passed"
    summary = "; ".join(
        f"{role} {e['mode']}: ppl {e['accuracy']['ppl_rel_change']:+.2%}, top-1 {e['accuracy']['top1_agreement']:.3f},"
        f" KL {e['accuracy']['mean_kl']:.3g}" + (" (over budget)" if e["violations"] else "")
        for role, e in per_engine.items()
    ) or "no accuracy numbers"
    return CheckResult(NAME, status, summary, failures, warnings, {"applicable": True, "modes": modes, "engines": per_engine})


def _budget(recorded: Optional[AccuracyBudget], gate: GateConfig) -> AccuracyBudget:
    overrides = {k: v for k, v in gate.quantization.model_dump(exclude={"enabled"}).items() if v is not None}
    return AccuracyBudget(**{**(recorded.model_dump() if recorded else {}), **overrides})


def _remeasure(folder: Path, role: str, entry: Built, manifest: Manifest):
    """Measure the quantized engine against the unquantized one the build kept, on the evaluation set."""
    from transformers import AutoTokenizer

    from specpipe.contract.quant import QuantConfig
    from specpipe.quantize import measure_accuracy
    from specpipe.quantize.calibration import evaluation_batches

    reference = entry.quant.reference_path if entry.quant else None
    if not reference or not (folder / reference).is_dir():
        raise GateError(f"--remeasure: the build kept no unquantized {role} engine to measure against (manifest: {reference!r})")
    tokenizer = AutoTokenizer.from_pretrained(str(folder / manifest.tokenizer.path))
    quant_cfg = QuantConfig(mode=entry.quant_mode)
    return measure_accuracy(folder / reference, folder / entry.engine.path, evaluation_batches(tokenizer, quant_cfg))
