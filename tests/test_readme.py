"""The README's usage example runs as written, from the repository root and from elsewhere (CPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _first_python_block(path: Path) -> str:
    match = re.search(r"```python\n(.*?)```", path.read_text(), re.S)
    assert match, f"no python block in {path}"
    return match.group(1)


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_readme_example_runs(tmp_path, where):
    code = _first_python_block(ROOT / "README.md") + "\nassert y.shape == y_ep.shape == (T, H)\nprint('ok')\n"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    cwd = ROOT if where == "root" else tmp_path
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("ok")
