"""The training example across processes and its memory plan: two `jax.distributed` processes on this host (4 CPU
devices each, coordinator on 127.0.0.1) train a few FSDP x EP steps of one job; `--dry-run` compiles the step
for a mesh without allocating and prints XLA's per-device memory analysis as an estimate."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_qwen3_moe.py"
SMALL = [
    "--batch",
    "8",
    "--seq",
    "16",
    "--eval-every",
    "2",
    "--eval-batches",
    "1",
    "--corpus-bytes",
    "50000",
    "--layers",
    "2",
    "--implementation",
    "cpu",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_one_job(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # each process gets its own 4 host devices (--host-devices)
    address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(SCRIPT),
                *SMALL,
                "--steps",
                "3",
                "--fsdp",
                "--host-devices",
                "4",
                "--coordinator-address",
                address,
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--out-dir",
                str(tmp_path / f"p{i}"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=420)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{out[-4000:]}"
    summary = json.loads((tmp_path / "p0" / "summary.json").read_text())  # process 0 writes the outputs
    assert summary["num_devices"] == 8 and summary["mesh"] == {"data": 2, "expert": 4}
    assert summary["steps"] == 3 and summary["final_loss"] == summary["final_loss"]  # finite (not NaN)
    assert not (tmp_path / "p1" / "summary.json").exists()


def test_dry_run_prints_the_memory_plan_without_training(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--preset",
            "tiny",
            "--layers",
            "3",
            "--mesh-expert",
            "4",
            "--fsdp",
            "--remat",
            "--remat-save-moe",
            "--batch",
            "8",
            "--seq",
            "64",
            "--dry-run",
            "--out-dir",
            str(tmp_path),
        ],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=420,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "ESTIMATE on cpu host devices" in result.stdout
    for field in ("arguments", "outputs", "temporaries", "generated_code", "total"):
        assert field in result.stdout
    plan = json.loads((tmp_path / "memory_plan.json").read_text())
    assert plan["estimate"] and plan["mesh"] == {"data": 2, "expert": 4} and plan["layers"] == 3
    assert plan["attention_impl"] == "chunked" and plan["fits"] and plan["allocator_limit_bytes"] is None
    sizes = plan["per_device_bytes"]
    # The arguments are the train state's shards and the batch: FSDP halves every matrix, experts over 4.
    assert (
        sizes["params"] + sizes["optimizer_state"]
        <= sizes["arguments"]
        < 1.01 * (sizes["params"] + sizes["optimizer_state"]) + 8 * 65 * 4
    )
    assert sizes["optimizer_state"] == 2 * sizes["params"] + 4 * 2  # AdamW's two moments, float32, and counts
    assert sizes["total"] == (
        sizes["arguments"] + sizes["outputs"] - sizes["aliased"] + sizes["temporaries"] + sizes["generated_code"]
    )
    assert not (tmp_path / "metrics.jsonl").exists()
