"""The benchmark scripts, run from the repository root as modules of this package, with jax_megamoe installed:

    python -m benchmarks.bench_moe --configs q30 --json bench_moe.json

Each script that times several implementations runs each one in a process of its own (so that its peak memory is
its own), the same module with `--child`, which prints its row as one tagged JSON line: `run_child`.
"""

from __future__ import annotations

import argparse
import json
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root, where `benchmarks` is a package


def run_child(
    module: str,
    args: list[str],
    tag: str,
    *,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    tail_chars: int = 300,
) -> tuple[dict | None, str]:
    """`python -m MODULE ARGS` from the repository root, output captured: `(the last row it printed after `tag`,
    "")`, or `(None, "crashed rc=N: ...")` with the last lines of its output (`tail_chars` of them at most) where it
    printed none. Raises `subprocess.TimeoutExpired` past `timeout` seconds."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    found = [line for line in proc.stdout.splitlines() if line.startswith(tag)]
    if found:
        return json.loads(found[-1][len(tag) :]), ""
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return None, f"crashed rc={proc.returncode}: " + " | ".join(tail)[:tail_chars]


def add_peer_site(folder: str | None) -> None:
    """Makes the peers' packages in `folder` (e.g. tokamax, installed there with `pip install --target`) importable
    after the environment's own, as a site directory; nothing where `folder` is None or empty."""
    if folder:
        site.addsitedir(folder)


def comma_list(known, cast=str):
    """An argparse `type`: a comma-separated list of values (`cast` each), every one in `known` (None: any)."""

    def parse(text):
        values = [cast(v.strip()) for v in text.split(",") if v.strip()]
        unknown = [v for v in values if known is not None and v not in known]
        if not values or unknown:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(map(str, known or ()))}: {text!r}")
        return values

    return parse
