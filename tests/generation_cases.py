"""Prompts and the log-prob comparison shared by the generation tests (CPU and GPU)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx
from hf_models import HF_CONFIG
from moe_cases import seeded_rng

from jax_megamoe import rl
from jax_megamoe.models import qwen3_moe

PROMPT_LENGTHS = (5, 11, 3, 8)


def prompts_of(lengths, seed=0) -> list[list[int]]:
    """Random prompts of the tiny model's vocabulary, one of each length."""
    rng = seeded_rng("generate prompts", seed)
    return [rng.integers(0, HF_CONFIG["vocab_size"], n).tolist() for n in lengths]


def generated_and_trained_logprobs(model, prompts, new_tokens, **sampling):
    """`generate`'s log-probs and the training forward's on the sequences it made (prompt then completion,
    right-padded, positions from 0, as a trainer sees them), both `[B, new_tokens]`."""
    out = qwen3_moe.generate(model, prompts, max_new_tokens=new_tokens, **sampling)
    sequences = np.zeros((len(prompts), max(map(len, prompts)) + new_tokens), np.int32)
    for row, prompt in enumerate(prompts):
        sequences[row, : len(prompt)] = prompt
        sequences[row, len(prompt) : len(prompt) + new_tokens] = out.tokens[row]
    logits, _ = nnx.jit(lambda m, ids: m(ids))(model, jnp.asarray(sequences))
    trained = qwen3_moe.token_logprobs(logits[:, :-1], jnp.asarray(sequences[:, 1:]))
    starts = [len(prompt) - 1 for prompt in prompts]
    return np.asarray(out.logprobs), np.stack([trained[row, s : s + new_tokens] for row, s in enumerate(starts)])


def sampler_and_trainer_logprobs(model, prompts, new_tokens, **sampling):
    """What the sampler and the trainer make of one generation, over its sampled tokens (flat, row by row):
    `generate`'s log-probs, the training forward's (`rl.sequence_logprobs` over the RL job's rows, `rl.pack`), the
    training forward's with the sampler's routing record replayed, and `rerouted`: true where some sparse layer of
    the trainer routed the token that predicts this one, or a token before it, apart from the sampler."""
    out = qwen3_moe.generate(model, prompts, max_new_tokens=new_tokens, return_routing=True, **sampling)
    prompt_ids, prompt_lengths = rl.pad_prompts(prompts, max(map(len, prompts)))
    tokens, lengths, logprobs, routing = (np.asarray(a) for a in (out.tokens, out.lengths, out.logprobs, out.routing))
    rows = rl.pack(prompt_ids, prompt_lengths, tokens, lengths, logprobs, routing=routing)
    trainer = nnx.jit(lambda m, t, r: rl.sequence_logprobs(m, t, routing=r, return_routing=True))
    trained, aux = trainer(model, jnp.asarray(rows.tokens), None)
    replayed, _ = trainer(model, jnp.asarray(rows.tokens), jnp.asarray(rows.routing))
    recorded = np.sort(rows.routing[:, :-1].astype(np.int32), axis=-1)
    chosen = np.sort(np.asarray(aux.routing, np.int32), axis=-1)
    apart = np.any((recorded != chosen) & (recorded >= 0), axis=(-2, -1))  # [R, S - 1]
    rerouted = np.logical_or.accumulate(apart, axis=1)
    sampled = rows.mask > 0
    return (
        rows.sampler_logprobs[sampled],
        np.asarray(trained)[sampled],
        np.asarray(replayed)[sampled],
        rerouted[sampled],
    )
