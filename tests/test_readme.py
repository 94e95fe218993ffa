"""The README's usage example runs as written, from the repository root and from elsewhere (CPU), and prints what
the README shows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _first_block(path: Path, language: str) -> str:
    match = re.search(rf"```{language}\n(.*?)```", path.read_text(), re.S)
    assert match, f"no {language} block in {path}"
    return match.group(1)


def _printed(text: str) -> dict[str, float]:
    """`label: value` lines as a dict."""
    return {label: float(value) for label, value in (line.rsplit(": ", 1) for line in text.strip().splitlines())}


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_readme_example_runs(tmp_path, where):
    code = _first_block(ROOT / "README.md", "python") + "\nassert y.shape == y_ep.shape == (T, H)\n"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    cwd = ROOT if where == "root" else tmp_path
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed, shown = _printed(proc.stdout), _printed(_first_block(ROOT / "README.md", "text"))
    assert printed.keys() == shown.keys()
    # The test runs on 8 host devices, where y_ep may differ from y by rounding: both differences stay within it.
    scale = printed["largest |y|"]
    assert scale == shown["largest |y|"]
    assert 0 < printed["largest |y - y_ref|"] <= 2**-7 * scale
    assert printed["largest |y_ep - y|"] <= 2**-7 * scale
