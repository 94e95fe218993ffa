"""GPU training runs (marker `gpu`; run on an H200 with `pytest -m gpu tests/test_train_gpu.py`): the main
job trains with the CUDA backend, its loss curve matches the reference backend's, and the Qwen3-30B-A3B
4-layer preset runs with both the CUDA backend and the ragged_dot baseline."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_qwen3_moe.py"


def train(out_dir: Path, *args) -> list[dict]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    command = [sys.executable, str(SCRIPT), "--mesh-data", "1", "--mesh-expert", "1", "--out-dir", str(out_dir), *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["num_devices"] == 1 and summary["device"].lower() != "cpu", summary["device"]
    with open(out_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def lm_losses(records):
    return np.array([r["lm_loss"] for r in records])


def test_cuda_loss_curve_matches_reference_backend(tmp_path):
    common = ["--preset", "tiny", "--steps", "40", "--batch", "16", "--seq", "256", "--eval-every", "40"]
    cuda = lm_losses(train(tmp_path / "cuda", "--backend", "cuda", *common))
    ref = lm_losses(train(tmp_path / "reference", "--backend", "reference", *common))
    assert cuda[-5:].mean() < cuda[:5].mean() - 1.0  # it learns
    np.testing.assert_allclose(cuda, ref, rtol=1e-2)  # bf16, 40 steps apart only by rounding


@pytest.mark.parametrize("backend", ["cuda", "ragged_dot"])
def test_qwen3_30b_a3b_width_preset_trains(tmp_path, backend):
    records = train(tmp_path / backend, "--preset", "qwen3-30b-a3b-4layer", "--backend", backend, "--steps", "8",
                    "--batch", "1", "--seq", "2048", "--eval-every", "8", "--eval-batches", "1")
    losses = lm_losses(records)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0]
    assert records[-1]["mfu"] > 0
