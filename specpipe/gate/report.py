"""The gate's results and the files it leaves: junit.xml (for CI), report.json (for scripts) and
report.html with plots (for people).

Statuses: passed, failed, skipped (does not apply in this mode), error (the check could not finish).
A gate passes when no check failed or errored; warnings (e.g. greedy near-ties) do not fail it.
"""

from __future__ import annotations

import base64
import html
import json
import math
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Optional

Status = Literal["passed", "failed", "skipped", "error"]


@dataclass
class CheckResult:
    name: str  # greedy_equivalence, distribution_equivalence, quantization_accuracy, latency_slo, robustness
    status: Status
    summary: str  # one line
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status in ("passed", "skipped")


@dataclass
class GateReport:
    mode: str  # in-process | repo | url
    target: str
    gate: dict
    checks: list[CheckResult]
    started: str
    duration_s: float
    versions: dict = field(default_factory=dict)
    machine: dict = field(default_factory=dict)  # specpipe.machine record of where the gate ran (with --url: the client)
    # what the subject could not establish (through an endpoint: no token ids, no weights, ...), one line each
    not_checked: list[str] = field(default_factory=list)
    report_dir: Optional[Path] = None

    @property
    def passed(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def check(self, name: str) -> CheckResult:
        return next(c for c in self.checks if c.name == name)

    def failed_checks(self) -> list[str]:
        return [c.name for c in self.checks if not c.ok]

    def summary_lines(self) -> list[str]:
        lines = [f"{c.status.upper():7s} {c.name}: {c.summary}" for c in self.checks]
        verdict = "PASSED" if self.passed else "FAILED (" + ", ".join(self.failed_checks()) + ")"
        lines += [f"NOT CHECKED {line}" for line in self.not_checked]
        lines.append(f"gate {verdict} in {self.duration_s:.1f} s")
        if self.report_dir is not None:
            lines.append(f"report: {self.report_dir / 'report.html'}")
        return lines

    def as_dict(self) -> dict:
        return {
            "passed": self.passed,
            "mode": self.mode,
            "target": self.target,
            "started": self.started,
            "duration_s": self.duration_s,
            "versions": self.versions,
            "machine": self.machine,
            "gate": self.gate,
            "checks": [asdict(c) for c in self.checks],
            "not_checked": self.not_checked,
        }


def write_report(report: GateReport, report_dir: Path) -> Path:
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    report.report_dir = report_dir
    (report_dir / "report.json").write_text(json.dumps(_finite(report.as_dict()), indent=2, default=str) + "\n")
    write_junit(report, report_dir / "junit.xml")
    plots = write_plots(report, report_dir)
    write_html(report, report_dir / "report.html", plots)
    return report_dir


def write_junit(report: GateReport, path: Path) -> None:
    """One <testcase> per check; failed -> <failure>, error -> <error>, skipped -> <skipped>."""
    counts = {s: sum(c.status == s for c in report.checks) for s in ("failed", "error", "skipped")}
    suites = ET.Element("testsuites", name="specpipe validate")
    suite = ET.SubElement(
        suites,
        "testsuite",
        name="specpipe.gate",
        tests=str(len(report.checks)),
        failures=str(counts["failed"]),
        errors=str(counts["error"]),
        skipped=str(counts["skipped"]),
        time=f"{report.duration_s:.3f}",
        timestamp=report.started,
    )
    props = ET.SubElement(suite, "properties")
    for key, value in (("mode", report.mode), ("target", report.target), *_machine_properties(report.machine)):
        ET.SubElement(props, "property", name=key, value=str(value))
    for line in report.not_checked:
        ET.SubElement(props, "property", name="not_checked", value=line)
    for check in report.checks:
        case = ET.SubElement(suite, "testcase", classname="specpipe.gate", name=check.name, time=f"{check.duration_s:.3f}")
        details = "\n".join(check.failures + [f"warning: {w}" for w in check.warnings])
        if check.status == "failed":
            ET.SubElement(case, "failure", message=check.summary, type="GateCheckFailed").text = details
        elif check.status == "error":
            ET.SubElement(case, "error", message=check.summary, type="GateCheckError").text = details
        elif check.status == "skipped":
            ET.SubElement(case, "skipped", message=check.summary)
        ET.SubElement(case, "system-out").text = json.dumps(_finite(check.metrics), indent=1, default=str)
    ET.indent(suites)
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)


def _machine_properties(machine: dict) -> list[tuple[str, str]]:
    """machine (the one-line summary), machine.cpu_model, machine.isa (the flags present), machine.threads."""
    if not machine:
        return []
    isa = [flag for flag, present in machine.get("isa", {}).items() if present]
    return [("machine", machine.get("summary", "")), ("machine.cpu_model", machine.get("cpu_model") or ""),
            ("machine.isa", " ".join(isa)), ("machine.threads", (machine.get("threads") or {}).get("in_use") or "")]


def write_plots(report: GateReport, report_dir: Path) -> dict[str, Path]:
    """latency.png (TTFT and inter-token latency), acceptance.png (per position), throughput.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots: dict[str, Path] = {}
    latency = next((c.metrics for c in report.checks if c.name == "latency_slo" and c.metrics.get("runs")), None)
    if latency is None:
        return plots
    runs = latency["runs"]  # {"speculative": {...}, "target_only": {...}}

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, title in ((axes[0], "ttft_ms", "time to first token"), (axes[1], "itl_ms", "inter-token latency")):
        data = [runs[name]["samples"][key] for name in runs if runs[name]["samples"][key]]
        labels = [name for name in runs if runs[name]["samples"][key]]
        if data:
            ax.boxplot(data, showfliers=True)
            ax.set_xticks(range(1, len(labels) + 1), labels)
        ax.set_title(title)
        ax.set_ylabel("ms")
    fig.tight_layout()
    plots["latency"] = _save(fig, report_dir / "latency.png", plt)

    per_position = runs.get("speculative", {}).get("per_position_acceptance") or []
    if per_position:
        fig, ax = plt.subplots(figsize=(5, 3.6))
        ax.bar([str(i + 1) for i in range(len(per_position))], per_position, color="tab:green")
        ax.set_ylim(0, 1)
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_title("per-position acceptance")
        fig.tight_layout()
        plots["acceptance"] = _save(fig, report_dir / "acceptance.png", plt)

    fig, ax = plt.subplots(figsize=(5, 3.6))
    names = list(runs)
    values = [runs[name]["tokens_per_s"] for name in names]
    ax.bar(names, values, color=["tab:blue", "tab:gray"][: len(names)])
    ax.set_ylabel("tokens/s (all requests)")
    ax.set_title(f"throughput at concurrency {latency.get('concurrency')}")
    fig.tight_layout()
    plots["throughput"] = _save(fig, report_dir / "throughput.png", plt)
    return plots


def _save(fig, path: Path, plt) -> Path:
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_html(report: GateReport, path: Path, plots: dict[str, Path]) -> None:
    """A single self-contained page: verdict, one section per check (summary, failures, numbers), plots."""
    esc = html.escape
    verdict = "PASSED" if report.passed else "FAILED"
    parts = [
        "<!doctype html><meta charset='utf-8'><title>specpipe gate report</title>",
        "<style>body{font-family:sans-serif;max-width:1000px;margin:2em auto}"
        ".passed{color:#1a7f37}.failed,.error{color:#cf222e}.skipped{color:#777}"
        "pre{background:#f6f8fa;padding:.6em;overflow-x:auto;font-size:85%}td,th{padding:.2em .8em;text-align:left}</style>",
        f"<h1>specpipe gate: <span class='{'passed' if report.passed else 'failed'}'>{verdict}</span></h1>",
        f"<p>{esc(report.mode)} &middot; {esc(report.target)} &middot; {esc(report.started)} &middot; "
        f"{report.duration_s:.1f} s</p>",
        f"<p>measured on: {esc(report.machine.get('summary', 'unknown machine'))}</p>",
        "<table><tr><th>check</th><th>status</th><th>summary</th></tr>",
    ]
    for c in report.checks:
        parts.append(f"<tr><td>{esc(c.name)}</td><td class='{c.status}'>{c.status}</td><td>{esc(c.summary)}</td></tr>")
    parts.append("</table>")
    if report.not_checked:
        parts.append("<h3>not checked through this subject</h3><ul>"
                     + "".join(f"<li>{esc(line)}</li>" for line in report.not_checked) + "</ul>")
    for name, png in plots.items():
        data = base64.b64encode(Path(png).read_bytes()).decode()
        parts.append(f"<h3>{esc(name)}</h3><img alt='{esc(name)}' src='data:image/png;base64,{data}'>")
    for c in report.checks:
        parts.append(f"<h2 id='{esc(c.name)}'>{esc(c.name)} <span class='{c.status}'>{c.status}</span></h2>")
        parts.append(f"<p>{esc(c.summary)}</p>")
        for title, items in (("failures", c.failures), ("warnings", c.warnings)):
            if items:
                parts.append(f"<h4>{title}</h4><ul>" + "".join(f"<li>{esc(i)}</li>" for i in items) + "</ul>")
        metrics = {k: v for k, v in c.metrics.items() if k != "runs"}
        parts.append(f"<pre>{esc(json.dumps(_finite(metrics), indent=1, default=str))}</pre>")
    if report.machine:
        parts.append(f"<h2>machine</h2><pre>{esc(json.dumps(report.machine, indent=1, default=str))}</pre>")
    parts.append(f"<h2>gate file</h2><pre>{esc(json.dumps(report.gate, indent=1, default=str))}</pre>")
    Path(path).write_text("\n".join(parts))


def _finite(value):
    """JSON has no inf/nan: write them as strings so report.json stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
