"""CPU smoke tests of benchmarks/nccl_concurrency.py: the MoE beside collectives on two host devices, and its
watchdog."""

from __future__ import annotations

import json
import subprocess
import sys

from bench_scripts import run_script

from benchmarks import ROOT


def test_nccl_concurrency_runs_moe_and_collectives_on_two_cpu_devices(tmp_path):
    out = tmp_path / "concurrency.json"
    flags = "--transport xla --iters 3 --collective-mib 1 --config tiny --nccl-max-ctas 32"
    proc = run_script("nccl_concurrency.py", str(out), *flags.split(), devices=2, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["devices"] == 2 and result["transport"] == "xla"
    assert result["iterations_done"] == 3 and result["hangs"] == 0
    assert result["checksum_mismatches"] == 0 and result["collectives_exact"] is True
    assert result["env"]["NCCL_MAX_CTAS"] == "32" and result["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert result["time_per_iteration_ms"]["median"] > 0


def test_nccl_concurrency_watchdog_aborts_a_stuck_iteration():
    # The watchdog alone (no JAX): an iteration armed and never disarmed must end the process with exit 3.
    code = (
        "import time\nfrom benchmarks import nccl_concurrency as n\n"
        "watchdog = n.Watchdog(0.2, lambda iteration, start: print('hung at', iteration, flush=True))\n"
        "watchdog.arm(7)\n"
        "time.sleep(30)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "hung at 7"
