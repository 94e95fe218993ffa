"""CPU smoke tests of benchmarks/bench_ep.py (expert parallelism): its transport list, the nvlink transport's
workspace, and emulated shards on one device."""

from __future__ import annotations

import argparse
import json

import pytest
from bench_scripts import run_script

from benchmarks import bench_ep


def test_bench_ep_transport_list():
    assert bench_ep.parse_transports("xla,ragged,nvlink") == ["xla", "ragged", "nvlink"]
    assert bench_ep.parse_transports(" xla , xla ") == ["xla"]
    for bad in ("", "xla,bogus", "nvlink_stage1", "auto"):
        with pytest.raises(argparse.ArgumentTypeError, match="comma list"):
            bench_ep.parse_transports(bad)


class _FakeWorkspace:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


def test_bench_ep_nvlink_opens_its_workspace_and_passes_the_transport(monkeypatch):
    # "nvlink" runs moe_ffn_ep with transport=NvlinkTransport(workspace), the workspace closed after the block.
    import jax_megamoe as jmm

    monkeypatch.setattr(jmm, "NvlinkTransport", lambda workspace: ("transport of", workspace))
    with bench_ep.ep_options("nvlink", _FakeWorkspace) as options:
        kind, workspace = options["transport"]
        assert kind == "transport of" and isinstance(workspace, _FakeWorkspace) and list(options) == ["transport"]
        assert not workspace.closed
    assert workspace.closed
    with bench_ep.ep_options("xla", _FakeWorkspace) as options:
        assert options == {"transport": "xla"}


def test_bench_ep_emulated_shards_on_one_cpu_device(tmp_path):
    # 4 emulated shards under vmap on one device: xla measured, ragged recorded as failed (exit 1), the JSON
    # names the emulation and every row has its times or its error. One sample of one call: the plumbing only.
    out = tmp_path / "ep.json"
    flags = "--config tiny --emulate 4 --transport xla,ragged --routing uniform --samples 1 --calls 1"
    proc = run_script("bench_ep.py", str(out), *flags.split())
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        proc.stderr.strip().splitlines()[-1]
        == "bench_ep.py: error: transports failed: ragged (errors in the table and JSON)"
    )
    result = json.loads(out.read_text())
    assert result["config"]["emulated_shards"] == 4 and result["failed_transports"] == ["ragged"]
    assert result["config"]["transports"] == ["xla", "ragged"]
    assert result["timing"].startswith("median over 1 samples of 1 back-to-back calls")
    baseline, xla, ragged = result["rows"]
    assert baseline["impl"] == "moe_ffn" and xla["impl"] == "moe_ffn_ep(emulated R=4, transport=xla)"
    assert xla["forward_ms"] > 0 and xla["forward_ratio"] == pytest.approx(xla["forward_ms"] / baseline["forward_ms"])
    assert "transport='ragged'" in ragged["error"]


def test_bench_ep_runs_the_fp8_recipe_on_both_sides(tmp_path):
    out = tmp_path / "ep.json"
    proc = run_script(
        "bench_ep.py",
        str(out),
        *("--config", "tiny", "--emulate", "2", "--routing", "zipf", "--recipe", "fp8_blockwise"),
        *("--samples", "1", "--calls", "1"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["config"]["recipe"] == "fp8_blockwise" and result["failed_transports"] == []
    baseline, xla = result["rows"]
    assert baseline["forward_backward_ms"] > 0 and xla["forward_backward_ms"] > 0


def test_bench_ep_emulate_refuses_a_mesh():
    proc = run_script("bench_ep.py", "/dev/null", "--emulate", "2", "--ep", "2", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "usage: bench_ep.py [options] json_path  (--help lists them)",
        "bench_ep.py: error: --emulate R needs R >= 1 and no --ep (got --emulate 2, --ep 2)",
    ]
