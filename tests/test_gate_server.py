"""`specpipe validate` through a real Triton server (tiny pair): the repository mode that starts the server
itself, and --url against a running server whose decoder has the planted bias.

Same reduced gate as tests/test_gate.py; through the server each sample is a whole gRPC request, so the
distribution check uses server_samples = 300 per case (it then detects TV >= ~0.3, stated in the report).
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from specpipe.speculative.verify import PLANTED_BIAS_ENV
from tests.test_gate import _toml, one_line_error, small_gate, validate, write_toml


@pytest.fixture(scope="module")
def tiny_repo(tiny_build, tmp_path_factory):
    from specpipe.triton import write_repository

    repo = tmp_path_factory.mktemp("gate_repo")
    write_repository(tiny_build, repo, instance_count=2)
    return repo


def test_passing_gate_through_the_server(tiny_repo, tmp_path, capsys):
    gate = write_toml(tmp_path / "gate.toml", _toml(small_gate()))
    code, out, err = validate(capsys, tiny_repo, "--gate", gate, "--report-dir", tmp_path / "r", "--quiet")
    assert code == 0, out + err
    saved = json.loads((tmp_path / "r" / "report.json").read_text())
    assert saved["mode"] == "repo"
    checks = {c["name"]: c for c in saved["checks"]}
    assert {name: c["status"] for name, c in checks.items()} == dict.fromkeys(checks, "passed"), out
    robustness = checks["robustness"]["metrics"]
    assert robustness["still_serving"] and all(robustness["refused"].values())
    dist = checks["distribution_equivalence"]["metrics"]
    assert dist["budget"] == "server_samples" and dist["samples_per_case"] == [300, 300]
    assert all(t["planted_rejection_rate"] >= 0.9 for t in dist["tests"] if t["informative"])
    assert checks["latency_slo"]["metrics"]["where"] == "server"
    suite = ET.parse(tmp_path / "r" / "junit.xml").getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("5", "0", "0", "0")


def test_planted_bias_in_the_server_fails_the_distribution_check(tiny_repo, tiny_build, tmp_path, monkeypatch, capsys):
    from specpipe.triton import ServerConfig, TritonServer

    monkeypatch.setenv(PLANTED_BIAS_ENV, "always-accept")  # the server process inherits it
    gate = write_toml(tmp_path / "gate.toml", _toml(small_gate(latency={"enabled": False})))
    config = ServerConfig.on_free_ports()
    with TritonServer(tiny_repo, config) as server:
        code, out, err = validate(
            capsys, "--url", server.url, "--engines", tiny_build, "--gate", gate, "--report-dir", tmp_path / "r", "--quiet"
        )
    assert code == 1, out + err
    assert "gate failed: distribution_equivalence" in one_line_error(err)
    saved = json.loads((tmp_path / "r" / "report.json").read_text())
    assert saved["mode"] == "url"
    assert [c["name"] for c in saved["checks"] if c["status"] not in ("passed", "skipped")] == ["distribution_equivalence"]
