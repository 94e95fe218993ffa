"""CPU tests of benchmarks/profile_decode.py (one decode step's device time by part of the model): a tiny run on
the host's ops, the mapping of scopes to parts, and its command-line check."""

from __future__ import annotations

import json

import pytest
from bench_scripts import run_script

from benchmarks.profile_decode import PARTS, part_of


def test_profile_decode_splits_a_tiny_decode_step_by_part(tmp_path):
    out = tmp_path / "profile.json"
    flags = "--model tiny --batch 2 --prompt 8 --new 4 --json"
    proc = run_script("profile_decode.py", *flags.split(), str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert set(result["parts_us"]) == {*PARTS, "rest"}
    assert all(us > 0 for us in result["parts_us"].values()), result["parts_us"]
    assert result["step_kernels_us"] == pytest.approx(sum(result["parts_us"].values()))
    assert sum(k["us_per_step"] for k in result["kernels"]) == pytest.approx(result["step_kernels_us"])
    assert "one decode step's /host:CPU ops" in proc.stdout


def test_part_of_maps_a_scope_to_the_part_it_names():
    assert part_of("jit(generate)/while/body/decode_step/attention/dot_general") == "attention"
    assert part_of("decode_step/moe/ffi_call") == "moe"
    assert part_of("decode_step/lm_head") == "lm_head"
    assert part_of("decode_step/moe_like/add") == "rest"  # whole scope names only
    assert part_of("") == "rest"


def test_profile_decode_refuses_a_loop_without_steps():
    proc = run_script("profile_decode.py", "--new", "1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--new must be at least 2" in proc.stderr
