"""The test base of `jax_megamoe.losses.linear_cross_entropy`: every implementation of its cross-entropy rows
(`"reference"`, `"cpu"`, `"cuda"`) runs the same checks, against optax's cross-entropy of the full logits and,
row by row, against the reference rows, on fresh seeded inputs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from moe_cases import seeded_rng

from jax_megamoe import losses


def problem(seed, tokens, hidden, vocab, dtype):
    rng = seeded_rng("linear cross-entropy", seed, tokens, hidden, vocab, jnp.dtype(dtype).name)
    h = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    kernel = jnp.asarray(rng.standard_normal((hidden, vocab)) / np.sqrt(hidden), dtype)
    labels = jnp.asarray(rng.integers(0, vocab, tokens), jnp.int32).at[1 % tokens].set(-100)
    where = jnp.asarray(rng.random(tokens) > 0.25)
    return h, kernel, labels, where


def optax_loss(h, kernel, labels, where, reduction):
    logits = jnp.dot(h.astype(jnp.float32), kernel.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
    mask = (labels >= 0) & where
    total = jnp.sum(jnp.where(mask, per_token, 0.0))
    return total / jnp.maximum(jnp.sum(mask), 1) if reduction == "mean" else total


def rel(a, b):
    return float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))


class LinearCrossEntropyBase:
    IMPLEMENTATION: str

    def lce(self, *args, **kwargs):
        return losses.linear_cross_entropy(*args, implementation=self.IMPLEMENTATION, **kwargs)

    @pytest.mark.parametrize("reduction", ["mean", "sum"])
    @pytest.mark.parametrize("chunk_bytes", [None, 4 * 61 * 5])  # one chunk, or chunks of 5 tokens, a ragged last
    def test_matches_optax_float32(self, monkeypatch, reduction, chunk_bytes):
        if chunk_bytes is not None:
            monkeypatch.setattr(losses, "_CHUNK_LOGITS_BYTES", chunk_bytes)
        h, kernel, labels, where = problem(0, 23, 16, 61, jnp.float32)

        def ours(h, k):
            return 3.0 * self.lce(h, k, labels, where=where, reduction=reduction)

        def ref(h, k):
            return 3.0 * optax_loss(h, k, labels, where, reduction)

        value, grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1)))(h, kernel)
        ref_value, ref_grads = jax.value_and_grad(ref, argnums=(0, 1))(h, kernel)
        assert value.dtype == jnp.float32
        assert abs(float(value - ref_value)) <= 1e-5 * abs(float(ref_value))
        for g, r in zip(grads, ref_grads, strict=True):
            assert rel(g, r) <= 1e-5
        assert float(self.lce(h, kernel, labels, where=where, reduction=reduction)) == pytest.approx(
            float(ref_value) / 3.0, rel=1e-5
        )

    @pytest.mark.parametrize("vocab", [64, 67])  # 16-byte accesses, or not
    def test_bf16_inputs(self, monkeypatch, vocab):
        monkeypatch.setattr(losses, "_CHUNK_LOGITS_BYTES", 2 * vocab * 8)
        h, kernel, labels, where = problem(1, 40, 32, vocab, jnp.bfloat16)
        value, (gh, gk) = jax.value_and_grad(self.lce, argnums=(0, 1))(h, kernel, labels, where=where)
        ref_value, (rh, rk) = jax.value_and_grad(optax_loss, argnums=(0, 1))(h, kernel, labels, where, "mean")
        assert gh.dtype == jnp.bfloat16 and gk.dtype == jnp.bfloat16
        assert abs(float(value - ref_value)) <= 1e-2 * abs(float(ref_value))
        assert rel(gh, rh) <= 1e-2 and rel(gk, rk) <= 1e-2

    def test_never_materialises_the_logits(self, monkeypatch):
        monkeypatch.setattr(losses, "_CHUNK_LOGITS_BYTES", 4 * 97 * 4)
        h, kernel, labels, _ = problem(2, 64, 8, 97, jnp.float32)
        grad = jax.grad(functools.partial(self.lce, labels=labels), argnums=(0, 1))
        text = jax.jit(grad).lower(h, kernel).as_text()
        assert "64x97" not in text  # no [N, V] tensor, only [chunk, V] ones
        assert "4x97" in text

    def test_all_tokens_ignored_gives_zero(self):
        h, kernel, labels, _ = problem(3, 6, 8, 10, jnp.float32)
        labels = jnp.full_like(labels, -100)
        value, (gh, gk) = jax.value_and_grad(self.lce, argnums=(0, 1))(h, kernel, labels)
        assert float(value) == 0.0 and not np.any(np.asarray(gh)) and not np.any(np.asarray(gk))

    def test_traced_label_outside_the_vocabulary_is_ignored(self):
        h, kernel, labels, where = problem(4, 12, 8, 33, jnp.float32)
        outside = labels.at[5].set(33).at[7].set(2**30)
        counted = where.at[5].set(False).at[7].set(False)
        ours = jax.jit(jax.value_and_grad(lambda h, k, lab: self.lce(h, k, lab, where=where), argnums=(0, 1)))
        value, grads = ours(h, kernel, outside)
        ref_value, ref_grads = jax.value_and_grad(optax_loss, argnums=(0, 1))(h, kernel, labels, counted, "mean")
        assert abs(float(value - ref_value)) <= 1e-5 * abs(float(ref_value))
        for g, r in zip(grads, ref_grads, strict=True):
            assert rel(g, r) <= 1e-5

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    # The last two are rows wider than the CUDA kernel's cluster of blocks holds in shared memory.
    @pytest.mark.parametrize(
        "rows, vocab", [(1, 1), (9, 61), (7, 64), (5, 3000), (3, 20011), (2, 2**20), (2, 10**6 + 3)]
    )
    def test_rows_match_the_reference_rows(self, dtype, rows, vocab):
        """The rows target alone: losses and scaled logit gradients, the ignored rows all zero (the gradient is
        written over the logits, so a row left unwritten would keep its logits)."""
        rng = seeded_rng("cross-entropy rows", rows, vocab, jnp.dtype(dtype).name)
        logits = jnp.asarray(4.0 * rng.standard_normal((rows, vocab)), dtype)
        labels = jnp.asarray(rng.integers(0, vocab, rows), jnp.int32).at[0].set(vocab - 1).at[-1].set(0)
        mask = jnp.asarray(rng.random(rows) > 0.3).at[0].set(True)
        scale = jnp.float32(0.37)
        loss, grad = jax.jit(functools.partial(losses._rows, self.IMPLEMENTATION))(logits, labels, mask, scale)
        ref_loss, ref_grad = losses._reference_rows(logits, labels, mask, scale)
        assert loss.dtype == jnp.float32 and grad.dtype == dtype and grad.shape == logits.shape
        np.testing.assert_allclose(np.asarray(loss), np.asarray(ref_loss), rtol=2e-6, atol=2e-5)
        rtol = 1e-5 if dtype == jnp.float32 else 2**-7  # bf16: the two roundings may differ by one unit
        np.testing.assert_allclose(
            np.asarray(grad.astype(jnp.float32)), np.asarray(ref_grad.astype(jnp.float32)), rtol=rtol, atol=1e-7
        )
        ignored = ~np.asarray(mask)
        assert not np.any(np.asarray(loss)[ignored]) and not np.any(np.asarray(grad.astype(jnp.float32))[ignored])
