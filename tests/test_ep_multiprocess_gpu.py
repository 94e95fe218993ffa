"""moe_ffn_ep across processes: two `jax.distributed` processes, one device each, one global "expert" mesh.

Each test starts two workers (tests/ep_multiprocess_worker.py) that build the same problem, run
`moe_ffn_ep` forward and all gradients over the global mesh, and check the shards they hold against the
float32 reference on the gathered problem (float32 <= 1e-5, bf16 <= 2e-2 normwise). The GPU test (marker
`gpu`) gives each worker one GPU through CUDA_VISIBLE_DEVICES and runs the xla transport over NCCL and
the nvlink transport through CUDA IPC, with its fused calls (copy-engine pushes and stream writes into the IPC
mappings; checked to be in the bf16 program; float32 falls back to "xla"). XLA refuses ragged_all_to_all across
processes, so moe_ffn_ep rejects "ragged" there; the CPU test runs the xla transport over gloo, so CI covers
the multi-process plumbing. This file
never initialises JAX in the pytest process (that could take GPUs the workers need): GPUs are counted
by tests/gpus.py. A worker that hangs fails the test after WORKER_TIMEOUT_S.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from gpus import visible_gpus

WORKER = Path(__file__).with_name("ep_multiprocess_worker.py")
WORKER_TIMEOUT_S = 300
NUM_PROCESSES = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def worker_env(process_id: int, platform: str, gpus: list[str]) -> dict[str, str]:
    """The parent's environment, with one device per worker and no forced host-device count (conftest's)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false", NCCL_NVLS_ENABLE="0")
    flags = [
        flag
        for flag in shlex.split(env.get("XLA_FLAGS", ""))
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join(flags)
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env["CUDA_VISIBLE_DEVICES"] = gpus[process_id]
        env.pop("JAX_PLATFORMS", None)
    return env


def run_workers(tmp_path: Path, platform: str, transports: str, gpus: Sequence[str] = ()) -> list[str]:
    """Runs the workers to completion; fails the test if any exits non-zero or all take too long."""
    coordinator = f"localhost:{free_port()}"
    logs = [tmp_path / f"worker{i}.log" for i in range(NUM_PROCESSES)]
    procs = []
    for process_id, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(WORKER),
                        "--process-id",
                        str(process_id),
                        "--num-processes",
                        str(NUM_PROCESSES),
                        "--coordinator",
                        coordinator,
                        "--transports",
                        transports,
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=worker_env(process_id, platform, list(gpus)),
                )
            )
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    # Poll all workers: if one dies, the other would wait on its collectives until the deadline.
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    reason = f"hung past {WORKER_TIMEOUT_S} s" if time.monotonic() >= deadline else "a peer failed"
    hung = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in hung:
        procs[i].kill()
        procs[i].wait()
    outputs = [log.read_text() for log in logs]
    report = "\n".join(
        f"--- worker {i} (rc={p.returncode}) ---\n{text[-6000:]}"
        for i, (p, text) in enumerate(zip(procs, outputs, strict=True))
    )
    assert not hung, f"workers {hung} killed: {reason}\n{report}"
    assert all(p.returncode == 0 for p in procs), f"a worker failed\n{report}"
    print(report)  # the per-shard errors, shown for passing tests with pytest -rA
    return outputs


def assert_all_checked(outputs: list[str], transports: str) -> None:
    """Every worker ran and passed every case: 2 dtypes x 3 routings x 5 outputs per transport, one shard each,
    plus the rejection of transport='ragged' across processes."""
    expected_lines = len(transports.split(",")) * 2 * 3 * 5 + 1
    for process_id, text in enumerate(outputs):
        passed = [line for line in text.splitlines() if line.startswith(f"ok   process {process_id} ")]
        assert len(passed) == expected_lines, (
            f"worker {process_id}: {len(passed)} checks passed, expected {expected_lines}\n{text[-6000:]}"
        )


def test_two_cpu_processes_match_reference(tmp_path):
    outputs = run_workers(tmp_path, "cpu", "xla")
    assert_all_checked(outputs, "xla")


@pytest.mark.gpu(count=NUM_PROCESSES)
def test_two_gpu_processes_match_reference(tmp_path):
    outputs = run_workers(tmp_path, "gpu", "xla,nvlink", visible_gpus())
    assert_all_checked(outputs, "xla,nvlink")
