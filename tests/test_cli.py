"""`jax_megamoe.cli`, the command lines' exit-code rule: a usage error exits 2 after the short usage line, a failed
run 1, each in one `PROG: error: ...` line; anything else keeps its traceback. (The jobs' and the benchmarks' own
errors: their tests.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys
from jax_megamoe import cli

def main():
    parser = cli.Parser(description="a job")
    parser.add_argument("path")
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    if args.steps < 1:
        raise cli.UsageError(f"--steps must be >= 1, got {args.steps}")
    if args.path == "fail":
        raise cli.RunError("the run failed: lower --lr")
    if args.path == "missing":
        open("/no/such/dir/file")
    if args.path == "bug":
        raise KeyError("a bug")
    print("ran", args.path)

cli.run(main)
"""


def job(*args):
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "args, code, lines",
    [
        (["ok"], 0, []),
        (
            [],
            2,
            ["usage: -c [options] path  (--help lists them)", "-c: error: the following arguments are required: path"],
        ),
        (
            ["ok", "--steps", "0"],
            2,
            ["usage: -c [options]  (--help lists them)", "-c: error: --steps must be >= 1, got 0"],
        ),
        (["fail"], 1, ["-c: error: the run failed: lower --lr"]),
        (["missing"], 1, ["-c: error: [Errno 2] No such file or directory: '/no/such/dir/file'"]),
    ],
)
def test_exit_codes_and_one_line_errors(args, code, lines):
    result = job(*args)
    assert result.returncode == code, result.stderr
    assert result.stderr.splitlines() == lines


def test_a_bug_keeps_its_traceback():
    result = job("bug")
    assert result.returncode == 1 and "Traceback" in result.stderr and "KeyError: 'a bug'" in result.stderr


def test_parsing_imports_no_jax():
    code = "import sys; from jax_megamoe import cli; cli.Parser().parse_args([]); print('jax' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr
