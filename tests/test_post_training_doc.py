"""docs/post_training.md's GRPO loop runs as written, from a directory outside the repository (so with the installed
package alone), and at each step's update the trainer's log-probs are the sampler's to float32 rounding."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "post_training.md"


def test_post_training_page_runs(tmp_path):
    [code] = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 1", "step 2"], proc.stdout
    for line in lines:
        reward, ratio = re.fullmatch(r"step \d: reward (\S+), largest \|log ratio\| (\S+)", line).groups()
        assert 0 <= float(reward) <= 1 and float(ratio) <= 1e-5, line
