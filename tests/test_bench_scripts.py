"""CPU smoke tests of the benchmark scripts' plumbing (their GPU numbers come from scripts/gpu_check.sh)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_ep  # noqa: E402  (benchmarks/ is not a package)
import bench_moe  # noqa: E402


def cpu_env(devices: int) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env.pop("NCCL_MAX_CTAS", None)
    return env


def test_nccl_concurrency_runs_moe_and_collectives_on_two_cpu_devices(tmp_path):
    out = tmp_path / "concurrency.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "nccl_concurrency.py"), str(out), "--backend", "xla", "--iters", "3",
         "--collective-mib", "1", "--config", "tiny", "--nccl-max-ctas", "32"],
        env=cpu_env(2), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["devices"] == 2 and result["backend"] == "xla"
    assert result["iterations_done"] == 3 and result["hangs"] == 0
    assert result["checksum_mismatches"] == 0 and result["collectives_exact"] is True
    assert result["env"]["NCCL_MAX_CTAS"] == "32" and result["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert result["time_per_iteration_ms"]["median"] > 0


def test_nccl_concurrency_watchdog_aborts_a_stuck_iteration():
    # The watchdog alone (no JAX): an iteration armed and never disarmed must end the process with exit 3.
    code = ("import time, nccl_concurrency as n\n"
            "watchdog = n.Watchdog(0.2, lambda iteration, start: print('hung at', iteration, flush=True))\n"
            "watchdog.arm(7)\n"
            "time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=BENCHMARKS, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "hung at 7"


def test_bench_ep_backend_list():
    assert bench_ep.parse_backends("xla,ragged,nvlink") == ["xla", "ragged", "nvlink"]
    assert bench_ep.parse_backends(" xla , xla ") == ["xla"]
    for bad in ("", "xla,bogus"):
        with pytest.raises(argparse.ArgumentTypeError, match="comma list"):
            bench_ep.parse_backends(bad)


def test_bench_moe_tiles_impl_names_give_the_gemm_tiles_variable():
    assert bench_moe.gemm_tiles_spec("ours") is None
    assert bench_moe.gemm_tiles_spec("ours_tiles_pp64x256_c1") == "pp64x256_c1"
    assert (bench_moe.gemm_tiles_spec("ours_tiles_fwd_down=pp128x128_c2+bwd_down=default")
            == "fwd_down=pp128x128_c2,bwd_down=default")
    with pytest.raises(ValueError, match="empty value"):
        bench_moe.gemm_tiles_spec("ours_tiles_")


def test_bench_moe_table_fits_long_impl_names():
    row = dict(impl="ours_tiles_fwd_gate_up=pp64x256_c1", config="q30s", routing="uniform", status="ok",
               fwd_ms=0.5, fwd_tflops=300.0, fwd_pct_matmul=43.0, fwd_bwd_ms=1.5, fwd_bwd_tflops=310.0,
               fwd_bwd_pct_matmul=44.0, peak_gib=3.7)
    header, line = bench_moe.table([row], 698.0).splitlines()[1:]
    assert line.startswith(row["impl"] + "  q30s") and header.index("config") == line.index("q30s")
