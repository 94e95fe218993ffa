"""`jax_megamoe.losses.linear_cross_entropy` against optax's cross-entropy of the full logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax_megamoe import losses


def _problem(seed, tokens, hidden, vocab, dtype):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    kernel = jnp.asarray(rng.standard_normal((hidden, vocab)) / np.sqrt(hidden), dtype)
    labels = jnp.asarray(rng.integers(0, vocab, tokens), jnp.int32).at[1].set(-100)
    where = jnp.asarray(rng.random(tokens) > 0.25)
    return h, kernel, labels, where


def _optax_loss(h, kernel, labels, where, reduction):
    logits = jnp.dot(h.astype(jnp.float32), kernel.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
    mask = (labels >= 0) & where
    total = jnp.sum(jnp.where(mask, per_token, 0.0))
    return total / jnp.maximum(jnp.sum(mask), 1) if reduction == "mean" else total


def _rel(a, b):
    return float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_bytes", [None, 4 * 61 * 5])  # one chunk, or chunks of 5 tokens with a ragged last
def test_matches_optax_float32(monkeypatch, reduction, chunk_bytes):
    if chunk_bytes is not None:
        monkeypatch.setattr(losses, "_CHUNK_LOGITS_BYTES", chunk_bytes)
    h, kernel, labels, where = _problem(0, 23, 16, 61, jnp.float32)

    def ours(h, k):
        return 3.0 * losses.linear_cross_entropy(h, k, labels, where=where, reduction=reduction)

    def ref(h, k):
        return 3.0 * _optax_loss(h, k, labels, where, reduction)

    value, grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1)))(h, kernel)
    ref_value, ref_grads = jax.value_and_grad(ref, argnums=(0, 1))(h, kernel)
    assert value.dtype == jnp.float32
    assert abs(float(value - ref_value)) <= 1e-5 * abs(float(ref_value))
    for g, r in zip(grads, ref_grads, strict=True):
        assert _rel(g, r) <= 1e-5
    assert float(losses.linear_cross_entropy(h, kernel, labels, where=where, reduction=reduction)) == pytest.approx(
        float(ref_value) / 3.0, rel=1e-5
    )


def test_bf16_inputs(monkeypatch):
    monkeypatch.setattr(losses, "_CHUNK_LOGITS_BYTES", 4 * 64 * 8)
    h, kernel, labels, where = _problem(1, 40, 32, 64, jnp.bfloat16)
    value, (gh, gk) = jax.value_and_grad(losses.linear_cross_entropy, argnums=(0, 1))(h, kernel, labels, where=where)
    ref_value, (rh, rk) = jax.value_and_grad(_optax_loss, argnums=(0, 1))(h, kernel, labels, where, "mean")
    assert gh.dtype == jnp.bfloat16 and gk.dtype == jnp.bfloat16
    assert abs(float(value - ref_value)) <= 1e-2 * abs(float(ref_value))
    assert _rel(gh, rh) <= 1e-2 and _rel(gk, rk) <= 1e-2


def test_never_materialises_the_logits(monkeypatch):
    monkeypatch.setattr(losses, "_CHUNK_LOGITS_BYTES", 4 * 97 * 4)
    h, kernel, labels, _ = _problem(2, 64, 8, 97, jnp.float32)
    text = jax.jit(jax.grad(losses.linear_cross_entropy, argnums=(0, 1))).lower(h, kernel, labels).as_text()
    assert "64x97" not in text  # no [N, V] tensor, only [chunk, V] ones
    assert "4x97" in text


def test_all_tokens_ignored_gives_zero():
    h, kernel, labels, _ = _problem(3, 6, 8, 10, jnp.float32)
    labels = jnp.full_like(labels, -100)
    value, (gh, gk) = jax.value_and_grad(losses.linear_cross_entropy, argnums=(0, 1))(h, kernel, labels)
    assert float(value) == 0.0 and not np.any(np.asarray(gh)) and not np.any(np.asarray(gk))


@pytest.mark.parametrize(
    "bad, error",
    [
        (dict(labels=[1, 2]), TypeError),
        (dict(labels=jnp.array([0, 10, 1])), ValueError),  # a concrete label >= V
        (dict(reduction="max"), ValueError),
        (dict(where=jnp.ones(3, jnp.int32)), ValueError),
        (dict(kernel=jnp.ones((5, 10))), ValueError),
    ],
)
def test_bad_arguments(bad, error):
    args = dict(hidden=jnp.ones((3, 4)), kernel=jnp.ones((4, 10)), labels=jnp.array([0, 1, 2]))
    args.update(bad)
    kwargs = {k: args.pop(k) for k in ("where", "reduction") if k in args}
    with pytest.raises(error):
        losses.linear_cross_entropy(args["hidden"], args["kernel"], args["labels"], **kwargs)
