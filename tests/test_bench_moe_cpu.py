"""CPU smoke tests of benchmarks/bench_moe_cpu.py (the CPU kernels against the reference): a small run and its
command-line checks."""

from __future__ import annotations

import json

import pytest
from bench_scripts import run_script


def test_bench_moe_cpu_times_the_kernels_and_the_reference(tmp_path):
    out = tmp_path / "bench_moe_cpu.json"
    args = ("--tokens", "8,24", "--dtypes", "bfloat16", "--hidden", "16", "--inter", "8", "--experts", "4")
    proc = run_script("bench_moe_cpu.py", *args, "--samples", "2", "--warmup", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert [(row["dtype"], row["tokens"]) for row in result["rows"]] == [("bfloat16", 8), ("bfloat16", 24)]
    for row in result["rows"]:
        for impl in ("cpu", "reference"):
            assert row[f"{impl}_fwd_ms"] > 0 and row[f"{impl}_fwd_bwd_ms"] > 0
    assert result["shape"] == dict(hidden=16, inter=8, experts=4, top_k=2)
    assert "| bfloat16 | 24 |" in proc.stdout


@pytest.mark.parametrize("flags", [("--tokens", "0"), ("--dtypes", "float16"), ("--top-k", "9")])
def test_bench_moe_cpu_rejects_a_bad_command_line(flags):
    proc = run_script("bench_moe_cpu.py", *flags)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("bench_moe_cpu.py: error: ")
