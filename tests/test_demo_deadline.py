"""The demo's 25-minute bound: the distillation's cap is what the bound leaves (specpipe/demo.py)."""

import time
from types import SimpleNamespace

import pytest
from rich.console import Console

from specpipe import demo


def test_the_cap_is_what_the_bound_leaves_within_its_limits():
    assert demo.distill_cap_minutes(0.0) == demo.DISTILL_MINUTES
    spent = demo.DEMO_MINUTES - demo.AFTER_DISTILL_MINUTES - demo.DISTILL_MINUTES + 1.5  # 1.5 min over the fit
    assert demo.distill_cap_minutes(spent) == pytest.approx(demo.DISTILL_MINUTES - 1.5)
    assert demo.distill_cap_minutes(demo.DEMO_MINUTES) == demo.MIN_DISTILL_MINUTES


def test_started_trusts_only_a_past_unix_time(monkeypatch):
    monkeypatch.setenv("SPECPIPE_DEMO_STARTED", "1000")
    assert demo._started() == 1000.0
    for bad in ("", "soon", str(time.time() + 3600), "-5"):
        monkeypatch.setenv("SPECPIPE_DEMO_STARTED", bad)
        assert abs(demo._started() - time.time()) < 60


def _asked_cap(monkeypatch, tmp_path, spent_minutes):
    asked = {}

    def distill(cfg, progress=None):
        asked["minutes"] = cfg.minutes
        raise RuntimeError("stop")

    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("specpipe.distill.distill", distill)
    state = demo.Demo(Console(file=None, record=True), started=time.time() - spent_minutes * 60)
    state.target = SimpleNamespace(weights_sha256="x")
    with pytest.raises(RuntimeError, match="stop"):
        demo.distill_draft(state)
    return asked["minutes"], state.console.export_text()


def test_the_distillation_gets_the_cap_the_clock_leaves(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECPIPE_DEMO_MINUTES", raising=False)
    spent = demo.DEMO_MINUTES - demo.AFTER_DISTILL_MINUTES - demo.DISTILL_MINUTES + 3.0
    minutes, text = _asked_cap(monkeypatch, tmp_path, spent)
    # the clock keeps running between the state's start and the call (seconds on a loaded machine): never more
    assert demo.DISTILL_MINUTES - 3.0 - 1.0 < minutes <= demo.DISTILL_MINUTES - 3.0
    assert "distillation capped at" in text and "bound spent" in text


def test_an_explicit_cap_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECPIPE_DEMO_MINUTES", "2.5")
    minutes, text = _asked_cap(monkeypatch, tmp_path, 20.0)
    assert minutes == 2.5 and "SPECPIPE_DEMO_MINUTES" in text


@pytest.mark.parametrize("value", ["soon", "0", "-3", "nan", "inf"])
def test_a_bad_explicit_cap_is_a_usage_error(monkeypatch, tmp_path, value):
    from specpipe.errors import UsageError

    monkeypatch.setenv("SPECPIPE_DEMO_MINUTES", value)
    with pytest.raises(UsageError, match="SPECPIPE_DEMO_MINUTES must be a positive number"):
        _asked_cap(monkeypatch, tmp_path, 0.0)
