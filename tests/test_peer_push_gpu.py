"""The nvlink transport's push between two GPUs, with its handshake (marker `gpu`): cuda/tests/peer_push_check.cu.

- The receiving GPU's stream poisons its landing rows and signals `ready` into the sender's memory; the sending
  GPU's stream waits (one bounded block) for it, moves the rows by DMA into the receiver's memory and writes
  `arrived` there (cuStreamWriteValue64 into peer memory); the receiver waits (bounded) for that and compares
  every byte. Seven rounds, enqueued up front, each side late in turn: the counters alone order the two GPUs.
- `timeout`: the receiver never frees round 2; the sender's wait ends in a trap after 200 ms and its failure
  record names the phase and round (exit code 3), instead of a hang.
"""

import subprocess

import pytest
from cuda_programs import NVCC, build

pytestmark = [pytest.mark.gpu(count=2), pytest.mark.skipif(NVCC is None, reason="needs nvcc to build the check")]


@pytest.fixture(scope="module")
def check_binary(tmp_path_factory):
    return build("peer_push_check", tmp_path_factory.mktemp("peer_push"))


def test_dma_push_with_ready_and_arrived_signals_in_peer_memory(check_binary):
    run = subprocess.run([str(check_binary)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "peer push ok" in run.stdout, run.stdout + run.stderr


def test_a_receiver_that_never_frees_its_rows_ends_the_senders_wait_with_a_record(check_binary):
    run = subprocess.run([str(check_binary), "timeout"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 3, run.stdout + run.stderr
    assert "sender waiting for ready in round 2" in run.stdout, run.stdout
