"""The validation gate (`specpipe validate`): prove a built deployment matches its target and meets its
latency targets, and leave a report for people (report.html) and CI (junit.xml, report.json).

    gate = load_gate("build/gate.toml")            # or GateConfig() for the default gate
    report = run_gate("engines/NAME", gate, "in-process", "reports/gate")
    report.passed, report.check("distribution_equivalence").metrics
"""

from specpipe.gate.gatefile import load_gate
from specpipe.gate.report import CheckResult, GateReport
from specpipe.gate.run import CHECKS, GateMode, run_gate

__all__ = ["CHECKS", "CheckResult", "GateMode", "GateReport", "load_gate", "run_gate"]
