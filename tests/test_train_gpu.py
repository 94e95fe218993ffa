"""GPU training runs (marker `gpu`; run on an H200 with `pytest -m gpu tests/test_train_gpu.py`): the main
job trains with the CUDA implementation, its loss curve matches the reference implementation's, the
Qwen3-30B-A3B 4-layer preset trains with the CUDA implementation, and on two GPUs the nvlink
expert-parallel transport trains like the xla one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gpus import visible_gpus

pytestmark = pytest.mark.gpu

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_qwen3_moe.py"


def train(out_dir: Path, *args, gpus: int = 1) -> list[dict]:
    """Runs the script on the first `gpus` visible GPUs, all on the expert axis; returns its metrics."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(visible_gpus()[:gpus]))
    command = [
        sys.executable,
        str(SCRIPT),
        "--mesh-data",
        "1",
        "--mesh-expert",
        str(gpus),
        "--out-dir",
        str(out_dir),
        *args,
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["num_devices"] == gpus and summary["device"].lower() != "cpu", summary["device"]
    with open(out_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def lm_losses(records):
    return np.array([r["lm_loss"] for r in records])


def test_cuda_loss_curve_matches_reference_implementation(tmp_path):
    common = ["--preset", "tiny", "--steps", "40", "--batch", "16", "--seq", "256", "--eval-every", "40"]
    cuda = lm_losses(train(tmp_path / "cuda", "--implementation", "cuda", *common))
    ref = lm_losses(train(tmp_path / "reference", "--implementation", "reference", *common))
    assert cuda[-5:].mean() < cuda[:5].mean() - 1.0  # it learns
    # bf16 rounding differences grow along the trajectory: at 40d453b every step agreed within 1%, at 2596be0 one
    # late step (28) differed by 1.9% while steps 0-17 agreed within 2e-4. So the early steps are held tightly and
    # the late ones as a window.
    np.testing.assert_allclose(cuda[:20], ref[:20], rtol=2e-3)
    np.testing.assert_allclose(cuda[-10:].mean(), ref[-10:].mean(), rtol=1e-2)


@pytest.mark.alone  # tens of GiB: beside other test processes it could run out of memory
def test_qwen3_30b_a3b_width_preset_trains(tmp_path):
    """The CUDA implementation trains the 30B-width model. The ragged_dot baseline cannot on one H200: it asks for
    64-66 GiB in one allocation (measured on an H200)."""
    records = train(
        tmp_path / "cuda",
        "--preset",
        "qwen3-30b-a3b-4layer",
        "--implementation",
        "cuda",
        "--steps",
        "8",
        "--batch",
        "1",
        "--seq",
        "2048",
        "--eval-every",
        "8",
        "--eval-batches",
        "1",
    )
    losses = lm_losses(records)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0]
    assert records[-1]["mfu"] > 0


@pytest.mark.gpu(count=2)
def test_nvlink_transport_trains_like_xla(tmp_path):
    """--transport nvlink on a 1 x 2 mesh: its workspace fits the train and eval steps and the losses follow
    the xla transport's (bitwise per call, tests/test_nn.py; separate processes may autotune differently)."""
    common = ["--preset", "tiny", "--steps", "20", "--batch", "16", "--seq", "256", "--eval-every", "10"]
    xla = train(tmp_path / "xla", *common, "--transport", "xla", gpus=2)
    nvlink = train(tmp_path / "nvlink", *common, "--transport", "nvlink", gpus=2)
    assert json.loads((tmp_path / "nvlink" / "summary.json").read_text())["transport"] == "nvlink"
    assert lm_losses(nvlink)[-5:].mean() < lm_losses(nvlink)[:5].mean()
    np.testing.assert_allclose(lm_losses(nvlink), lm_losses(xla), rtol=1e-2)
    np.testing.assert_allclose(
        [r["eval_loss"] for r in nvlink if "eval_loss" in r],
        [r["eval_loss"] for r in xla if "eval_loss" in r],
        rtol=1e-2,
    )
