"""Choosing the next token from logits, and the log-probabilities a policy-gradient loss compares.

`process_logits` is transformers' sampling pipeline with its order and tie rules (temperature, then top-k, then
top-p), so `sample_logits` draws from exactly the distribution `softmax(process_logits(logits))`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raises ValueError or TypeError for sampling settings `process_logits` does not take."""
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise TypeError(f"temperature must be a float >= 0 (0: greedy), got {temperature!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite float >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k (the sampling filter) must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a float in (0, 1], got {top_p!r}")


def process_logits(
    logits: jax.Array, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> jax.Array:
    """The logits `[..., V]` sampling draws from, float32, the filtered-out tokens at -inf.

    In transformers' order and with its tie rules: divided by `temperature` (> 0); then top-k keeps every token
    whose logit is at least the k-th largest (ties with it kept); then top-p sorts the tokens by logit, ascending
    (ties in index order), and drops those whose cumulative probability is at most `1 - top_p`, keeping at least
    the most likely one. `top_k` here is the sampling filter (the model's `num_experts_per_tok` is the other
    top-k, the experts per token).
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        raise ValueError("process_logits needs temperature > 0 (temperature=0 is greedy: no distribution)")
    logits = logits.astype(jnp.float32) / jnp.float32(temperature)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1:
        order = jnp.argsort(logits, axis=-1, stable=True)
        ascending = jnp.take_along_axis(logits, order, axis=-1)
        removed = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1) <= 1 - top_p
        removed = removed.at[..., -1].set(False)
        removed = jnp.take_along_axis(removed, jnp.argsort(order, axis=-1), axis=-1)
        logits = jnp.where(removed, -jnp.inf, logits)
    return logits


def sample_logits(
    key: jax.Array | None,
    logits: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> jax.Array:
    """The next tokens `[...]` (int32) for `logits [..., V]`: drawn from `softmax(process_logits(logits, ...))`
    with `key`, or with `temperature=0` the most likely (the lowest index among ties; no key needed)."""
    if temperature == 0:
        check_sampling(temperature, top_k, top_p)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if key is None:
        raise ValueError(f"sampling at temperature={temperature} needs a key (jax.random.key(seed)); 0 is greedy")
    processed = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return jax.random.categorical(key, processed, axis=-1).astype(jnp.int32)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """`log_softmax(logits)[..., tokens]` in float32 at temperature 1 (`logits [..., V]`, `tokens [...]`): the
    log-probability of each token under the model, whatever filters chose it."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(log_probs, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
