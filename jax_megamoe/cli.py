"""How a command-line job ends on an error: exit status 2 for a command line that cannot run, after the short
usage line; 1 for a run that fails; each ends in one `PROG: error: ...` line that says what to change. The example
jobs (examples/) and the benchmark scripts (benchmarks/) follow it; so can a user's own script:

    from jax_megamoe import cli

    def main(argv=None):
        parser = cli.Parser(description=...)
        ...

    if __name__ == "__main__":
        cli.run(main)

`Parser` raises `UsageError` for argparse's own errors, and the job raises it for the flags it can only check
later (against the devices, the model, a checkpoint); the job raises `RunError` for failures of the run itself.
Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class UsageError(Exception):
    """The command line asks for something that cannot run: the message names the flag and what to pass instead.

    `usage`: the job's short usage line, where the parser that found the error knows it."""

    def __init__(self, message: str, usage: str | None = None):
        super().__init__(message)
        self.usage = usage


class RunError(Exception):
    """The run failed for a reason its user can act on: the message says what happened and what to change."""


def usage_line(prog: str, positionals: str = "") -> str:
    return f"usage: {prog} [options]{positionals}  (--help lists them)"


class Parser(argparse.ArgumentParser):
    """An `ArgumentParser` whose errors raise `UsageError`, and whose usage line is one short line."""

    def error(self, message: str):
        raise UsageError(message, usage=self.format_usage().rstrip("\n"))

    def format_usage(self) -> str:
        positionals = "".join(f" {action.metavar or action.dest}" for action in self._get_positional_actions())
        return usage_line(self.prog, positionals) + "\n"


def run(main: Callable[[], T]) -> T:
    """Returns `main()`; a `UsageError` exits with status 2 after the usage line, a `RunError` or an `OSError` (a
    file that cannot be read or written) with status 1, each printed as one `PROG: error: ...` line."""
    prog = os.path.basename(sys.argv[0])
    try:
        return main()
    except UsageError as error:
        sys.stderr.write(f"{error.usage or usage_line(prog)}\n{prog}: error: {error}\n")
        sys.exit(2)
    except (RunError, OSError) as error:
        sys.stderr.write(f"{prog}: error: {error}\n")
        sys.exit(1)
