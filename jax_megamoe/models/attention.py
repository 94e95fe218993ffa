"""The model's GQA attention: causal over a sequence (training and prefill), optionally with a padding mask, and
over a KV cache whose queries start after the cached keys (decoding).

Every form computes the scores and the softmax in float32 and the product with `v` in `v`'s dtype, the numerics
of `jax.nn.dot_product_attention`'s XLA form, so that decoding over a cache gives the logits of the forward over
the whole sequence.
"""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp


def chunked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    block: int = 512,
    key_mask: jax.Array | None = None,
    query_positions: jax.Array | None = None,
) -> jax.Array:
    """Masked GQA attention `q [B, T, N, D]`, `k, v [B, S, Nkv, D]` -> `[B, T, N, D]`, over query blocks.

    Key j is visible to query i of row b where `j <= query_positions[b, i]` (default `i`: causal, the queries
    and keys starting together) and `key_mask[b, j]` (default: every key). With a KV cache `k, v` are its slots
    (slot j holds position j) and `query_positions` the queries' positions, so the keys beyond a query are
    hidden whatever the slots hold. A query that sees no key gets the mean of `v` (no NaN).

    Each block's float32 scores `[B, N, block, S]` live only inside one step of a scan whose steps are
    checkpointed (the backward recomputes them block by block), so memory grows as `S * block`, not `S * T`:
    pure JAX, any platform. Numerically `jax.nn.dot_product_attention(..., is_causal=True)`'s XLA form
    (float32 scores and softmax, the product with `v` in `v`'s dtype).
    """
    batch, queries, heads, dim = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    block = max(b for b in range(1, min(block, queries) + 1) if queries % b == 0)
    blocks = queries // block
    grouped = q.reshape(batch, blocks, block, kv_heads, heads // kv_heads, dim).swapaxes(0, 1)
    if query_positions is None:
        query_positions = jnp.broadcast_to(jnp.arange(queries), (1, queries))
    positions = query_positions.reshape(-1, blocks, block).swapaxes(0, 1)
    key_slots = jnp.arange(keys)
    visible_keys = None if key_mask is None else key_mask.astype(bool)[:, None, None, None, :]
    precision = jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if q.dtype == jnp.bfloat16 else None

    @jax.checkpoint
    def one_block(carry, inputs):
        q_block, block_positions = inputs
        scores = (
            jnp.einsum("bqhgd,bkhd->bhgqk", q_block, k, precision=precision, preferred_element_type=jnp.float32)
            * dim**-0.5
        )
        visible = (key_slots <= block_positions[:, :, None])[:, None, None]
        if visible_keys is not None:
            visible = visible & visible_keys
        probs = jax.nn.softmax(jnp.where(visible, scores, jnp.finfo(jnp.float32).min), axis=-1)
        return carry, jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v)

    _, out = jax.lax.scan(one_block, None, (grouped, positions))
    return out.swapaxes(0, 1).reshape(batch, queries, heads, dim)


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: str | None, key_mask: jax.Array | None = None
) -> jax.Array:
    """Causal GQA attention of a whole sequence `q [B, S, N, D]`, `k, v [B, S, Nkv, D]`: key j visible to query i
    where `j <= i` and `key_mask[b, j]` (`[B, S]`, default every key; a padding mask).

    `implementation`: `jax.nn.dot_product_attention`'s (None: XLA; "cudnn" on GPUs), or "chunked"
    (`chunked_attention`)."""
    if implementation == "chunked":
        return chunked_attention(q, k, v, key_mask=key_mask)
    mask = None if key_mask is None else key_mask.astype(bool)[:, None, None, :]
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True, implementation=typing.cast(typing.Any, implementation)
    )
