"""The push of nvlink stage 2 between two GPUs (marker `gpu`): cuda/tests/peer_push_check.cu. The sending GPU's
stream moves rows by DMA into the receiving GPU's memory, then writes a counter there (cuStreamWriteValue64 into
peer memory); a kernel on the receiving GPU, already waiting (bounded), must see the counter and then every byte
of the rows, which are poisoned before each of the rounds."""

import subprocess

import jax
import pytest

from cuda_programs import NVCC, build

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(sum(d.platform == "gpu" for d in jax.devices()) < 2, reason="needs two GPUs"),
    pytest.mark.skipif(NVCC is None, reason="needs nvcc to build the check"),
]


def test_dma_push_and_stream_write_into_peer_memory(tmp_path):
    binary = build("peer_push_check", tmp_path)
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "peer push ok" in run.stdout, run.stdout + run.stderr
