"""Runs test code against the example jobs' recipes (examples/moe_training) the way the jobs' scripts reach them:
in a fresh Python whose current directory is examples/, where `import moe_training` finds the package beside the
scripts. The tests themselves import only the installed package."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_in_examples(code: str, env: dict[str, str] | None = None, timeout: int = 300) -> str:
    """Runs `code` (dedented) with `python -c` in examples/ on the CPU; returns its stdout, failing the test with
    its output where it exits non-zero."""
    env = dict(os.environ if env is None else env, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=EXAMPLES,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout
