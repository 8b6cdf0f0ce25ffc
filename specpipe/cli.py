"""specpipe command line. Each command builds a config, calls one library function, and prints."""

from __future__ import annotations

import sys

import click

from specpipe import __version__
from specpipe.errors import SpecpipeError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="specpipe")
def cli() -> None:
    """From two Hugging Face checkpoints to a validated speculative-decoding deployment.

    \b
    specpipe inspect CHECKPOINT
    specpipe build --target T --draft D
    specpipe generate engines/NAME --prompt "..."
    """


# ---- commands from other modules (specpipe/commands/<name>.py): one line each ----
from specpipe.commands.build import build; cli.add_command(build)  # noqa: E402,E702
from specpipe.commands.generate import generate; cli.add_command(generate)  # noqa: E402,E702
from specpipe.commands.inspect import inspect; cli.add_command(inspect)  # noqa: E402,E702
from specpipe.commands.serve import serve; cli.add_command(serve)  # noqa: E402,E702
from specpipe.commands.validate import validate; cli.add_command(validate)  # noqa: E402,E702
from specpipe.commands.distill import distill; cli.add_command(distill)  # noqa: E402,E702
from specpipe.commands.bench import bench; cli.add_command(bench)  # noqa: E402,E702
from specpipe.commands.loadtest import loadtest; cli.add_command(loadtest)  # noqa: E402,E702


def main(argv: list[str] | None = None) -> None:
    """Entry point: a SpecpipeError becomes one line on stderr and its exit code, never a traceback."""
    try:
        cli.main(args=argv, prog_name="specpipe", standalone_mode=False)
    except SpecpipeError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(err.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
