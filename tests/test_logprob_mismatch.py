"""CPU tests of benchmarks/logprob_mismatch.py (the sampler's log-probs against the trainer's, without and with
routing replay): its figures (`rl.mismatch_stats`) on hand-made values, a float32 run where both sides agree, and
its command-line checks."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from bench_scripts import run_script

from jax_megamoe import rl


def test_mismatch_figures_are_taken_over_the_masked_tokens():
    sampler = np.log(np.array([[0.5, 0.25, 0.1], [0.2, 0.2, 0.9]]))
    trainer = sampler + np.array([[0.1, -0.2, 7.0], [0.0, 0.05, 0.0]])  # 7.0 lies off the mask
    mask = np.array([[1, 1, 0], [1, 1, 1]])
    with jax.enable_x64(True):  # float64 throughout, as numpy states the expected figures
        figures = {name: float(v) for name, v in rl.mismatch_stats(trainer, sampler, mask).items()}
    ratios = np.array([0.1, -0.2, 0.0, 0.05, 0.0])
    assert figures["log_ratio_max"] == pytest.approx(0.2)
    assert figures["log_ratio_mean"] == pytest.approx(np.abs(ratios).mean())
    assert figures["log_ratio_p99"] == pytest.approx(np.quantile(np.abs(ratios), 0.99))
    assert figures["sampler_kl"] == pytest.approx(np.mean(np.exp(ratios) - 1 - ratios))


def test_float32_sampler_and_trainer_agree_without_and_with_replay(tmp_path):
    out = tmp_path / "mismatch.json"
    flags = "--implementations cpu,reference --dtype float32 --prompts 6 --prompt 12 --new 10 --json"
    proc = run_script("logprob_mismatch.py", *flags.split(), str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(row["implementation"], row["attention"]) for row in rows] == [("cpu", "xla"), ("reference", "xla")]
    for row in rows:
        assert row["tokens"] == 60 and row["routing_mismatch"] == 0
        assert row["log_ratio_max"] <= 1e-5 and row["replay_log_ratio_max"] <= 1e-5
    assert "| reference | xla |" in proc.stdout


def test_a_checkpoints_weights_are_measured(tmp_path):
    """`--checkpoint`: a saved model (here a random one of another width than `tiny`) is what every configuration
    runs; in float32 the two sides agree on it too."""
    import dataclasses

    from flax import nnx

    from jax_megamoe.models import qwen3_moe

    config = dataclasses.replace(qwen3_moe.tiny(), hidden_size=48)
    qwen3_moe.save_pretrained(qwen3_moe.Qwen3MoeForCausalLM(config, rngs=nnx.Rngs(5)), tmp_path / "model")
    out = tmp_path / "mismatch.json"
    flags = "--implementations cpu,reference --dtype float32 --prompts 4 --prompt 8 --new 6 --json"
    proc = run_script("logprob_mismatch.py", "--checkpoint", str(tmp_path / "model"), *flags.split(), str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(row["tokens"] == 24 and row["log_ratio_max"] <= 1e-5 for row in rows)
    assert f"{tmp_path / 'model'}, float32" in proc.stdout


@pytest.mark.parametrize(
    "flags",
    [
        ("--implementations", "triton"),
        ("--attention", "flash"),
        ("--new", "0"),
        ("--attention", "cudnn"),
        ("--checkpoint", "/nonexistent/model"),
        ("--model", "tiny", "--checkpoint", "/nonexistent/model"),
    ],
)
def test_logprob_mismatch_rejects_a_bad_command_line(flags):
    proc = run_script("logprob_mismatch.py", *flags)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("logprob_mismatch.py: error: ")
