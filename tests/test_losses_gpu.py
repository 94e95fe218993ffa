"""`jax_megamoe.losses.linear_cross_entropy` on CUDA (marker `gpu`): the shared checks (tests/loss_cases.py) for the
CUDA kernel of its cross-entropy rows, and a problem of a real vocabulary's width against the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from loss_cases import LinearCrossEntropyBase, problem, rel

from jax_megamoe import losses

pytestmark = pytest.mark.gpu


class TestCudaKernel(LinearCrossEntropyBase):
    IMPLEMENTATION = "cuda"


def test_auto_picks_the_cuda_kernel():
    h, kernel, labels, _ = problem(6, 8, 16, 64, jnp.bfloat16)
    text = jax.jit(jax.grad(losses.linear_cross_entropy, argnums=(0, 1))).lower(h, kernel, labels).as_text()
    assert "jmm_cuda_cross_entropy_rows" in text


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_wide_vocabulary_matches_the_reference(monkeypatch, dtype):
    """3000 tokens over 151,936 ids in chunks of 700 tokens (a ragged last): the kernel against the reference,
    which reads the same logits from the same GEMM."""
    monkeypatch.setattr(losses, "_CHUNK_LOGITS_BYTES", jnp.dtype(dtype).itemsize * 151936 * 700)
    h, kernel, labels, where = problem(7, 3000, 256, 151936, dtype)

    def run(implementation):
        def loss(h, k):
            return losses.linear_cross_entropy(h, k, labels, where=where, implementation=implementation)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(h, kernel)

    value, grads = run("cuda")
    ref_value, ref_grads = run("reference")
    assert abs(float(value - ref_value)) <= 1e-5 * abs(float(ref_value))
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.dtype == dtype
        assert rel(g, r) <= (1e-5 if dtype == jnp.float32 else 2e-3)
