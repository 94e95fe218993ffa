"""The main job, examples/train_qwen3_moe.py, run as users run it (a subprocess on 8 host CPU devices):
loss falls, outputs are written, resuming from a checkpoint reproduces the uninterrupted run's losses
exactly, bad flags get clear errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_qwen3_moe.py"
SMALL = ["--batch", "8", "--seq", "32", "--eval-every", "3", "--eval-batches", "1", "--corpus-bytes", "200000"]


def run(*args, check=True):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, str(SCRIPT), *SMALL, *args], capture_output=True, text=True, env=env,
                            timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def losses(out_dir):
    with open(out_dir / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def test_trains_and_resume_reproduces_the_loss(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    run("--steps", "6", "--out-dir", str(full))
    summary = json.loads((full / "summary.json").read_text())
    assert summary["mesh"] == {"data": 2, "expert": 4}
    assert summary["final_loss"] < summary["first_loss"]
    assert np.isfinite(summary["final_eval_loss"])
    assert (full / "loss_curve.png").stat().st_size > 0

    ckpt = tmp_path / "ckpt"
    run("--steps", "3", "--lr-decay-steps", "6", "--ckpt-dir", str(ckpt), "--ckpt-every", "3", "--out-dir", str(part))
    run("--steps", "6", "--ckpt-dir", str(ckpt), "--resume", "--out-dir", str(part))
    assert losses(part) == losses(full)  # bitwise: same data, same state, deterministic kernels


def test_token_file_expert_only_mesh_and_remat_saving_the_moe(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 200, 20000).astype(np.uint16)
    tokens.tofile(tmp_path / "tokens.bin")
    run("--steps", "1", "--data", str(tmp_path / "tokens.bin"), "--mesh-expert", "8", "--dtype", "float32",
        "--remat", "--remat-save-moe", "--out-dir", str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["mesh"] == {"data": 1, "expert": 8}


@pytest.mark.parametrize("args, message", [
    (["--data", "/no/such/file.npy"], "no such file"),
    (["--mesh-expert", "3"], "must use all 8 devices"),
    (["--batch", "12"], "divisible by the 8 devices"),
    (["--resume"], "--resume needs --ckpt-dir"),
    (["--remat-save-moe"], "--remat-save-moe needs --remat"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--ep-backend", "nvlink"], "--ep-backend nvlink: the nvlink transport"),  # no GPUs here
])
def test_bad_flags_get_clear_errors(args, message):
    result = run(*args, check=False)
    assert result.returncode == 2
    assert message in result.stderr
