"""Typed errors. Each carries the numbers that explain it; the CLI prints `str(err)` on one line."""

from __future__ import annotations


def last_line(text: str, limit: int = 300) -> str:
    """The last non-empty line of a tool's output (where its error usually is), cut to `limit` characters,
    for an error that must stay on one line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[-1] if lines else "(no output)"
    return line if len(line) <= limit else line[: limit - 3] + "..."


class SpecpipeError(Exception):
    """Base class. `exit_code` is what the CLI exits with (2 = usage/setup, 1 = a check failed)."""

    exit_code = 2


class UsageError(SpecpipeError):
    """Bad input from the user: a value out of range, a path that is not what it should be."""


class CheckpointError(SpecpipeError):
    """A checkpoint cannot be resolved, loaded or trusted."""


class HubUnavailableError(CheckpointError):
    """The model hub could not be reached; the user should pass a local path."""


class IncompatiblePairError(SpecpipeError):
    """Draft and target cannot be paired. Lists every problem found, not just the first."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("draft and target are incompatible: " + "; ".join(self.problems))


class OutputExistsError(UsageError):
    """The output exists and --force was not given."""


class ExportError(SpecpipeError):
    """Exporting a checkpoint to an engine failed."""


class ExportMismatchError(ExportError):
    """The engine's logits differ from the torch model's by more than the tolerance."""

    exit_code = 1

    def __init__(self, model: str, max_abs_diff: float, tolerance: float):
        self.model, self.max_abs_diff, self.tolerance = model, max_abs_diff, tolerance
        super().__init__(
            f"{model} engine does not match the torch model: max |logit diff| = {max_abs_diff:.3g}"
            f" > tolerance {tolerance:.3g}"
        )


class EngineError(SpecpipeError):
    """An engine folder is missing, corrupt, or cannot run the request."""


class AccuracyBudgetError(SpecpipeError):
    """A quantized engine is over its accuracy budget."""

    exit_code = 1

    def __init__(self, model: str, metric: str, value: float, limit: float, mode: str = ""):
        self.model, self.metric, self.value, self.limit, self.mode = model, metric, value, limit, mode
        super().__init__(
            f"{model} {mode} engine is over its accuracy budget: {metric} = {value:.4g}, limit {limit:.4g}"
            " (pass --accept-accuracy-loss to keep it anyway)"
        )


class ServerError(SpecpipeError):
    """The Triton server failed to start, load a model, or answer."""


class GateError(SpecpipeError):
    """The validation gate could not run (bad gate file, unreachable server)."""


class GateFailedError(SpecpipeError):
    """The validation gate ran and at least one check failed; the report has the numbers."""

    exit_code = 1

    def __init__(self, failed_checks: list[str], report_path: str):
        self.failed_checks, self.report_path = list(failed_checks), report_path
        super().__init__(f"gate failed: {', '.join(self.failed_checks)} (report: {report_path})")


def require_text(text: str, what: str) -> str:
    """`text` if it is valid Unicode, else UsageError naming the first bad byte. Python decodes command-line
    arguments that are not UTF-8 into lone surrogates (U+DC80..U+DCFF stand for the bytes 0x80..0xFF), which
    a tokenizer rejects with a TypeError and no hint."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        bad = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        raise UsageError(f"{what} is not valid UTF-8 text: {bad} at character {err.start}") from None
    return text
