"""The benchmark scripts, run from the repository root as modules of this package, with jax_megamoe installed:

    python -m benchmarks.bench_moe --configs q30 --json bench_moe.json

Each script that times several implementations runs each one in a process of its own (so that its peak memory is
its own), the same module with `--child`, which prints its row as one tagged JSON line: `run_child`.
"""

from __future__ import annotations

import argparse
import collections
import json
import site
import subprocess
import sys
import threading
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
    """`python -m MODULE ARGS` from the repository root, its output captured: `(the last row it printed after `tag`,
    "")`, or `(None, "crashed rc=N: ...")` with the last lines of its output (`tail_chars` of them at most) where it
    printed none. The child's stderr also passes through to ours as it comes, so that a run stopped from outside
    still shows how far each child got. Kills the child and raises `subprocess.TimeoutExpired` past `timeout`
    seconds."""
    with subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        err_tail: collections.deque[str] = collections.deque(maxlen=3)
        out: list[str] = []
        readers = [
            threading.Thread(target=_relay, args=(proc.stderr, err_tail)),
            threading.Thread(target=lambda stream=proc.stdout: out.append(stream.read())),
        ]
        for reader in readers:
            reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        finally:
            for reader in readers:
                reader.join()
    stdout = "".join(out)
    found = [line for line in stdout.splitlines() if line.startswith(tag)]
    if found:
        return json.loads(found[-1][len(tag) :]), ""
    tail = list(err_tail) or stdout.strip().splitlines()[-3:]
    return None, f"crashed rc={proc.returncode}: " + " | ".join(tail)[:tail_chars]


def _relay(stream, tail: collections.deque) -> None:
    """Copies `stream`'s lines to our stderr as they come, keeping the last non-empty ones in `tail`."""
    for line in stream:
        sys.stderr.write(line)
        sys.stderr.flush()
        if line.strip():
            tail.append(line.rstrip("\n"))


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
