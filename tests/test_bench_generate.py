"""CPU tests of benchmarks/bench_generate.py (decoding against transformers): both frameworks on the tiny model,
and the decode step's floor."""

from __future__ import annotations

import json

import pytest
from bench_scripts import run_script


def test_bench_generate_runs_both_frameworks_on_the_tiny_model(tmp_path):
    out = tmp_path / "generate.json"
    proc = run_script(
        "bench_generate.py",
        *("--models", "tiny", "--batches", "2", "--prompt", "8", "--new", "3", "--samples", "1"),
        *("--json", str(out)),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    bandwidth, ours, peer = result["rows"]
    assert bandwidth["impl"] == "read_bandwidth" and result["read_gb_per_s"] == bandwidth["gb_per_s"] > 0
    assert (ours["framework"], peer["framework"]) == ("ours", "transformers")
    for row in (ours, peer):
        assert row["status"] == "ok" and row["batch"] == 2 and row["generate_s"] > 0
        assert row["tokens_per_s"] == pytest.approx(2 * 3 / row["generate_s"])
        assert row["floor_ms"] > 0 and row["step_over_floor"] == pytest.approx(row["step_ms"] / row["floor_ms"])
    assert ours["floor_ms"] == peer["floor_ms"]  # one model, one batch: one floor
    assert "vs transformers" in proc.stdout and "x floor" in proc.stdout
    # Each child's progress comes through as it goes (so a run stopped from outside still shows how far it got).
    for line in ("ours:tiny:2:", "tiny: model built", "tiny: transformers model built", "generate 3 tokens: 1 timed"):
        assert line in proc.stderr, proc.stderr


def test_bench_generate_step_floor_counts_the_touched_experts():
    from benchmarks import bench_generate
    from jax_megamoe.models import qwen3_moe

    config = qwen3_moe.tiny()
    h, e, k, i = config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size
    one = bench_generate.step_floor_bytes(config, 1, 0)
    many = bench_generate.step_floor_bytes(config, 1000, 0)
    # One row touches K experts per layer, a large batch all E; the difference is the untouched experts' weights.
    assert many - one == pytest.approx(config.num_hidden_layers * (e - k) * 3 * h * i * 2)
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2
    assert bench_generate.step_floor_bytes(config, 1, 10) - one == pytest.approx(10 * per_token)
