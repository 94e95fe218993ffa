"""CPU tests of benchmarks/profile_ep.py: its summaries of a trace, and the whole script on two host devices."""

from __future__ import annotations

import json

import pytest
from bench_scripts import run_script


def test_profile_ep_sums_complete_events_per_device_process():
    from benchmarks import profile_ep

    trace = {
        "traceEvents": [
            {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:1"}},
            {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "X", "pid": 1, "tid": 7, "ts": 0, "dur": 300.0, "name": "gemm"},
            {"ph": "X", "pid": 1, "tid": 8, "ts": 10, "dur": 100.0, "name": "gemm"},
            {"ph": "X", "pid": 1, "tid": 7, "ts": 400, "dur": 50.0, "name": "nccl"},
            {"ph": "X", "pid": 2, "tid": 7, "ts": 0, "dur": 20.0, "name": "nccl"},
            {"ph": "i", "pid": 1, "tid": 7, "ts": 5, "name": "marker"},  # not a complete event
            {"ph": "X", "pid": 3, "tid": 1, "ts": 0, "dur": 999.0, "name": "host"},  # not a GPU
        ]
    }
    profile = profile_ep.per_step(profile_ep.kernel_times(trace, profile_ep.DEVICE_PROCESS), iters=2)
    assert sorted(profile) == ["/device:GPU:0", "/device:GPU:1"]
    gpu0 = profile["/device:GPU:0"]
    assert gpu0["events"] == [{"name": "gemm", "ms": 0.2, "calls": 1.0}, {"name": "nccl", "ms": 0.025, "calls": 0.5}]
    assert gpu0["total_ms"] == pytest.approx(0.225)
    assert profile["/device:GPU:1"]["events"] == [{"name": "nccl", "ms": 0.01, "calls": 0.5}]


def test_profile_ep_lays_out_the_last_step_in_time():
    from benchmarks import profile_ep

    # Three steps on GPU 0, told apart by the two longest idle gaps; within the last, a gap shorter than those and an
    # event on a second stream that overlaps the first.
    events = [
        (7, 0, 10, "a"),
        (7, 12, 5, "b"),
        (7, 500, 10, "a"),
        (8, 505, 20, "c"),
        (7, 1000, 10, "a"),
        (8, 1003, 2, "c"),
        (7, 1040, 30, "d"),
    ]
    trace = {
        "traceEvents": [
            {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7"}},
            {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "X", "pid": 3, "tid": 1, "ts": 2000, "dur": 9.0, "name": "host"},  # not a GPU
            *({"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": name} for tid, ts, dur, name in events),
        ]
    }
    timeline = profile_ep.last_step_timeline(trace, profile_ep.DEVICE_PROCESS, iters=3)
    assert timeline == {
        "/device:GPU:0": [
            {"stream": "Stream #7", "start_us": 0.0, "dur_us": 10.0, "name": "a"},
            {"stream": "8", "start_us": 3.0, "dur_us": 2.0, "name": "c"},
            {"stream": "Stream #7", "start_us": 40.0, "dur_us": 30.0, "name": "d"},
        ]
    }


def test_profile_ep_runs_on_two_cpu_devices(tmp_path):
    # The whole script on the host platform (no GPU processes in the trace there: the CPU's events instead).
    proc = run_script(
        "profile_ep.py",
        str(tmp_path),
        "--config",
        "tiny",
        "--ep",
        "2",
        "--iters",
        "2",
        "--process",
        "/host:CPU",
        devices=2,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "profile_ep.json").read_text())
    assert result["ranks"] == 2 and result["transport"] == "xla" and not result["emulated"]
    events = result["per_step"]["/host:CPU"]["events"]
    assert events and all(row["ms"] >= 0 for row in events)
