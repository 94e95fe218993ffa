"""CPU smoke test of benchmarks/bench_train.py (the training-step benchmark, its parts in benchmarks/train_bench/;
its GPU numbers come from a GPU run):
the tiny preset through ours (both heads), transformers and an unavailable peer, the JSON's fields, and the
pieces that run on their own (the peers' expert path, the xprof stub, the FLOP count, the flag checks)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import ROOT, bench_train
from benchmarks.train_bench import breakdown, common, expert_paths, rates
from jax_megamoe import cli

TINY_VOCAB = 256


def cpu_env() -> dict[str, str]:
    """One CPU device (conftest asks for 8 for the mesh tests)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")
    )
    return env


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_train")
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_train",
        "--preset",
        "tiny",
        "--layers",
        "1",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--stacks",
        "ours,ours_lce,tokamax,torch,ours_unrolled,ours_fp8",
        "--breakdown",
        "ours_lce",
        "--matmul-size",
        "128",
        "--profile",
        str(out / "profile"),
        "--json",
        str(out / "train.json"),
        "--png",
        str(out / "train.png"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "train.json").read_text()), proc.stdout, out


def test_tiny_run_reports_every_stack(tiny_run):
    result, stdout, out = tiny_run
    assert (out / "train.png").stat().st_size > 0
    assert result["preset"] == "tiny" and result["config"]["num_hidden_layers"] == 1
    assert (result["batch"], result["seq"], result["steps"], result["warmup"]) == (2, 32, 2, 1)
    assert result["tokens_per_step"] == 64 and result["flops_per_step"] > 0
    matmul = result["matmul"]
    assert matmul["status"] == "ok" and matmul["size"] == 128 and matmul["tflops"] > 0
    rows = {r["stack"]: r for r in result["stacks"]}
    assert list(rows) == ["ours", "ours_lce", "tokamax", "torch", "ours_unrolled", "ours_fp8"]
    # tokamax needs a GPU: recorded with its reason, and the other stacks still ran.
    assert rows["tokamax"]["status"].startswith("skipped:") and "GPU" in rows["tokamax"]["status"]
    ran = [rows[name] for name in ("ours", "ours_lce", "torch", "ours_unrolled", "ours_fp8")]
    for row in ran:
        assert row["status"] == "ok", row
        assert len(row["step_s"]) == 2 and row["median_step_ms"] > 0
        assert row["tokens_per_s"] == pytest.approx(64 / (row["median_step_ms"] / 1e3))
        assert row["mfu"] > 0 and row["model_tflops"] > 0
        assert "peak_memory_bytes" in row and row["peak_memory_bytes"] is None  # CPUs keep no statistics
        assert row["label"] in stdout
    # The same tokens and the same architecture (parameter count) in every stack.
    assert len({row["tokens_sha1"] for row in ran}) == 1
    assert len({row["parameters"] for row in ran}) == 1
    assert (rows["ours"]["head"], rows["ours_lce"]["head"]) == ("optax", "linear_cross_entropy")
    assert rows["ours"]["param_dtype"] == "float32" and rows["torch"]["param_dtype"] == "bfloat16"
    assert rows["ours"]["implementation"] == "auto (cpu)"
    assert rows["torch"]["experts_implementation"] == "grouped_mm" and rows["torch"]["attention_impl"] == "sdpa"


def test_tiny_run_first_losses_are_near_uniform(tiny_run):
    # Different initialisations, so no exact match: each first-step LM loss is near ln(vocab) at init.
    rows = {r["stack"]: r for r in tiny_run[0]["stacks"]}
    for name in ("ours", "ours_lce", "torch"):
        assert rows[name]["first_lm_loss"] == pytest.approx(math.log(TINY_VOCAB), rel=0.1), name
        assert rows[name]["first_loss"] >= rows[name]["first_lm_loss"]  # + the router's aux loss
    # Both of our heads, and the unrolled layers, see the same model and tokens: the same loss (bf16 compute, so
    # to its rounding under other fusions).
    assert rows["ours"]["first_lm_loss"] == pytest.approx(rows["ours_lce"]["first_lm_loss"], rel=1e-4)
    assert rows["ours"]["first_lm_loss"] == pytest.approx(rows["ours_unrolled"]["first_lm_loss"], rel=1e-4)
    assert (rows["ours"]["scan_layers"], rows["ours_unrolled"]["scan_layers"]) == (True, False)
    # FP8 experts: the same model and tokens through quantised GEMMs, near the bf16 loss
    assert (rows["ours"]["recipe"], rows["ours_fp8"]["recipe"]) == (None, "fp8_blockwise")
    assert rows["ours_fp8"]["first_lm_loss"] == pytest.approx(rows["ours"]["first_lm_loss"], rel=1e-2)


def test_tiny_run_profiles_the_jax_stacks(tiny_run):
    result, _, out = tiny_run
    rows = {row["stack"]: row for row in result["stacks"]}
    for name in ("ours", "ours_lce", "ours_unrolled", "ours_fp8"):
        [(process, profile)] = rows[name]["profile"].items()  # on a CPU the host's XLA threads: one process
        assert process.startswith("/host:CPU")
        assert profile["events_ms"] > 0 and profile["top"] and all(e["calls"] > 0 for e in profile["top"])
        last = profile["last_step"]
        assert last["busiest"] in last["streams"] and 0 <= last["idle_ms"] <= last["step_span_ms"]
        assert list((out / "profile" / name).glob("plugins/profile/*/perfetto_trace.json.gz"))
    assert "profile" not in rows["torch"]


def test_tiny_run_breakdown(tiny_run):
    rows = {r["stack"]: r for r in tiny_run[0]["stacks"]}
    assert "breakdown" not in rows["ours"] and "breakdown" not in rows["torch"]
    b = rows["ours_lce"]["breakdown"]
    for key in ("zero_experts_step_ms", "no_optimizer_step_ms", "lm_head_loss_ms"):
        assert b[key] > 0, key
    step = rows["ours_lce"]["median_step_ms"]
    assert b["experts_ms"] == pytest.approx(step - b["zero_experts_step_ms"])
    assert b["optimizer_ms"] == pytest.approx(step - b["no_optimizer_step_ms"])
    assert b["experts_ms"] + b["optimizer_ms"] + b["lm_head_loss_ms"] + b["rest_ms"] == pytest.approx(step)
    assert b["moe_ffn_alone_ms"] > 0
    assert b["experts_over_alone"] == pytest.approx(b["experts_ms"] / b["moe_ffn_alone_ms"])


def test_sorted_ragged_ffn_matches_the_reference():
    import jax
    import jax.numpy as jnp

    from jax_megamoe import reference

    t, h, i, e, k = 24, 16, 8, 4, 2
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (t, h))
    gu = jax.random.normal(keys[1], (e, h, 2 * i)) / 4
    d = jax.random.normal(keys[2], (e, i, h)) / 3
    experts = jax.random.randint(keys[3], (t, k), 0, e).at[0, 1].set(-1).at[3, 0].set(e)  # two dropped pairs
    weights = jax.nn.softmax(jax.random.normal(keys[0], (t, k)), axis=-1)
    ffn = expert_paths.sorted_ragged_ffn(jax.lax.ragged_dot)
    np.testing.assert_allclose(
        ffn(x, weights, experts, gu, d), reference.moe_ffn(x, weights, experts, gu, d), rtol=1e-5, atol=1e-5
    )
    zeros = breakdown.zero_experts(x, weights, experts, gu, d)
    assert zeros.shape == x.shape and not jnp.any(zeros)


def test_xprof_stub_satisfies_tokamax_import():
    code = (
        "from benchmarks.train_bench import expert_paths\n"
        "assert expert_paths.stub_xprof()\n"
        "from xprof.cli.tools import get_kernel_stats_tool\n"
        "try:\n    get_kernel_stats_tool()\nexcept RuntimeError as e:\n    print('stub:', e)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("stub:")


def test_flops_per_step_are_the_training_jobs():
    from jax_megamoe import training

    config = common.model_config("qwen3-30b-a3b-4layer", 4)
    assert rates.train_flops_per_step(config, 4, 4096) == training.train_flops_per_token(config, 4096) * 4 * 4096


@pytest.mark.parametrize("flag, value", [("--stacks", "ours,bogus"), ("--breakdown", "torch")])
def test_unknown_names_are_command_line_errors(flag, value):
    with pytest.raises(cli.UsageError, match=f"{flag}: unknown"):
        bench_train.main(["--preset", "tiny", flag, value])


def test_time_budget_stops_the_run_and_still_writes_the_json(tmp_path, capsys):
    out = tmp_path / "budget.json"
    result = bench_train.main(
        ["--preset", "tiny", "--stacks", "ours,torch", "--time-budget", "0.5", "--json", str(out), "--png", ""]
    )
    assert result["matmul"]["status"].startswith("timed out")
    assert [r["status"] for r in result["stacks"]] == ["not run: the time budget of 0.5 s was spent"] * 2
    assert json.loads(out.read_text())["stacks"][1]["stack"] == "torch"
    assert "not run" in capsys.readouterr().out
