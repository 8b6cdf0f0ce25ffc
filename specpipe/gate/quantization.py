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
from typing import Optional

from specpipe.config import AccuracyBudget, GateConfig
from specpipe.errors import GateError
from specpipe.gate.report import CheckResult

NAME = "quantization_accuracy"


def quant_mode(entry: dict) -> str:
    return str((entry.get("quant") or {}).get("mode") or entry.get("engine", {}).get("quant") or "none")


def check_quantization(manifest: dict, folder: Path, gate: GateConfig, *, remeasure: bool = False) -> CheckResult:
    from specpipe.quantize.accuracy import AccuracyReport, budget_violations

    roles = [(role, manifest[role]) for role in ("target", "draft") if isinstance(manifest.get(role), dict)]
    modes = {role: quant_mode(entry) for role, entry in roles}
    quantized = [(role, entry) for role, entry in roles if modes[role] != "none"]
    if not quantized:
        summary = "not applicable: no quantized engine in the manifest (" + ", ".join(f"{r} {m}" for r, m in modes.items()) + ")"
        return CheckResult(NAME, "passed", summary, metrics={"applicable": False, "modes": modes})

    failures, warnings, per_engine = [], [], {}
    for role, entry in quantized:
        block = entry.get("quant") or {}
        budget = _budget(block.get("budget"), gate)
        if remeasure:
            accuracy = _remeasure(folder, role, entry, block, manifest).as_dict()
        elif block.get("accuracy"):
            accuracy = block["accuracy"]
        else:
            failures.append(f"{role} ({modes[role]}): the manifest records no accuracy numbers; rebuild or use --remeasure")
            continue
        report = AccuracyReport(**accuracy)
        violations = budget_violations(report, budget)
        per_engine[role] = {
            "mode": modes[role], "accuracy": accuracy, "budget": budget.model_dump(),
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


def _budget(recorded: Optional[dict], gate: GateConfig) -> AccuracyBudget:
    overrides = {k: v for k, v in gate.quantization.model_dump(exclude={"enabled"}).items() if v is not None}
    return AccuracyBudget(**{**(recorded or {}), **overrides})


def _remeasure(folder: Path, role: str, entry: dict, block: dict, manifest: dict):
    """Measure the quantized engine against the unquantized one the build kept, on the evaluation set."""
    from transformers import AutoTokenizer

    from specpipe.config import QuantConfig
    from specpipe.quantize import measure_accuracy
    from specpipe.quantize.calibration import evaluation_batches

    reference = block.get("reference_path") or (entry.get("unquantized_engine") or {}).get("path")
    if not reference or not (folder / reference).is_dir():
        raise GateError(f"--remeasure: the build kept no unquantized {role} engine to measure against (manifest: {reference!r})")
    tokenizer = AutoTokenizer.from_pretrained(str(folder / manifest["tokenizer"]["path"]))
    quant_cfg = QuantConfig(mode=block.get("mode", entry["engine"]["quant"]))
    return measure_accuracy(folder / reference, folder / entry["engine"]["path"], evaluation_batches(tokenizer, quant_cfg))
