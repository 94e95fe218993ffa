"""GRPO's device side: the policy's log-prob of every target token of packed rollouts, the clipped-ratio loss with
an optional KL penalty towards a reference policy, and the supervised warm-up's loss on the same sequences."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_megamoe.models.qwen3_moe import token_logprobs

# Positions per block of the LM head's logits: a block's float32 logits [rows, block, vocab] are the only ones alive
# (recomputed in the backward), so a large vocabulary never holds [rows, seq, vocab] at once.
LOGIT_BLOCK = 128


def target_logprobs(hidden: jax.Array, kernel: jax.Array, targets: jax.Array) -> jax.Array:
    """`log_softmax(hidden @ kernel)[targets]`, float32 `[R, S]`, for `hidden [R, S, H]` and the LM head
    `kernel [H, V]`: the logits in the compute dtype, as the model's LM head computes them, then the sampler's
    `token_logprobs`."""
    rows, seq, width = hidden.shape
    block = min(seq, LOGIT_BLOCK)
    blocks = -(-seq // block)
    pad = blocks * block - seq
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(rows, blocks, block, width).swapaxes(0, 1)
    targets = jnp.pad(targets, ((0, 0), (0, pad))).reshape(rows, blocks, block).swapaxes(0, 1)

    @jax.checkpoint
    def one_block(carry, inputs):
        h, t = inputs
        return carry, token_logprobs(jnp.einsum("rsh,hv->rsv", h, kernel), t)

    _, logprobs = jax.lax.scan(one_block, None, (hidden, targets))
    return logprobs.swapaxes(0, 1).reshape(rows, blocks * block)[:, :seq]


def sequence_logprobs(model, tokens: jax.Array):
    """`(log-prob of tokens[:, 1:] given the tokens before, [R, S-1] float32; the model's MoEAux)`."""
    hidden, aux = model.hidden_states(tokens[:, :-1])
    return target_logprobs(hidden, model.lm_head_kernel(), tokens[:, 1:]), aux


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def grpo_loss(logprobs: jax.Array, batch, *, clip_epsilon: float, kl_coef: float) -> tuple[jax.Array, dict]:
    """GRPO's loss over the masked target tokens, each weighing alike: `-min(ratio * A, clip(ratio, 1 - eps,
    1 + eps) * A)` with `ratio = pi / pi_sampler` and `A` the row's advantage, plus `kl_coef` times the k3
    estimate of KL(pi || pi_reference), `r - log r - 1` with `r = pi_reference / pi` (where the batch has
    `reference_logprobs`). Statistics: the KL, the share of tokens whose ratio is clipped, and |log ratio|'s
    largest, mean and 99th-percentile values (at the first update of a batch the policy is the sampler's, so these
    measure how far the sampler's log-probs are from the trainer's)."""
    mask = batch.mask
    # Off the mask the log-probs are not comparable (the sampler's are 0 there): zero them before any exp.
    log_ratio = jnp.where(mask > 0, logprobs - batch.sampler_logprobs, 0.0)
    ratio = jnp.exp(log_ratio)
    advantages = batch.advantages[:, None]
    clipped = jnp.clip(ratio, 1 - clip_epsilon, 1 + clip_epsilon)
    per_token = -jnp.minimum(ratio * advantages, clipped * advantages)
    was_clipped = ((ratio < 1 - clip_epsilon) & (advantages < 0)) | ((ratio > 1 + clip_epsilon) & (advantages > 0))
    size = jnp.abs(log_ratio)
    stats = {
        "clip_fraction": masked_mean(was_clipped, mask),
        "log_ratio_max": jnp.max(size),
        "log_ratio_mean": masked_mean(size, mask),
        "log_ratio_p99": jnp.nanquantile(jnp.where(mask > 0, size, jnp.nan), 0.99),
    }
    if batch.reference_logprobs is not None:
        to_reference = jnp.where(mask > 0, batch.reference_logprobs - logprobs, 0.0)
        kl = jnp.exp(to_reference) - to_reference - 1
        stats["kl"] = masked_mean(kl, mask)
        per_token = per_token + kl_coef * kl
    return masked_mean(per_token, mask), stats
