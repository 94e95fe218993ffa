"""The arrival-gated grouped GEMM (cuda/nvlink/arrival_mainloop_sm90.hpp) on a GPU (marker `gpu`).

Builds cuda/tests/arrival_gemm_check.cu with nvcc against the installed CUTLASS headers and runs it twice:
- `overlap`: peer groups' A rows are NaN until a sender kernel on another stream, launched first and sleeping
  20 ms, writes them and releases their counter; the gated GEMM must wait (it finishes at least 10 ms after
  its launch), produce no NaN, and match a float32 reference (normwise relative error <= 1e-2);
- `timeout`: a counter never released ends the GEMM by a trap after the 200 ms bound, and the host-mapped
  failure record names a peer group (exit code 3), instead of a hang.
"""

import subprocess

import pytest
from cuda_programs import NVCC, build

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NVCC is None, reason="needs nvcc to build the check")]


@pytest.fixture(scope="module")
def check_binary(tmp_path_factory):
    return build("arrival_gemm_check", tmp_path_factory.mktemp("arrival"))


def test_gated_groups_wait_for_their_rows(check_binary):
    run = subprocess.run([str(check_binary), "overlap"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "overlap ok" in run.stdout, run.stdout + run.stderr


def test_a_counter_never_released_traps_with_a_record(check_binary):
    run = subprocess.run([str(check_binary), "timeout"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 3, run.stdout + run.stderr
    assert "failed 1, group" in run.stdout and "< target 1" in run.stdout, run.stdout
