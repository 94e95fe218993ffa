"""GRPO post-training over the models: rollouts, rewards, group advantages, the policy's log-probs and the loss.

One step of a user's loop (docs/post_training.md has it whole):

1. prompts as token ids, right-padded (`pad_prompts`, each repeated `group` times), sampled with
   `jax_megamoe.models.qwen3_moe.generate`, which returns the tokens, their log-probs and the lengths;
2. rewards of each prompt's group (`group_rewards` over a `RewardFn`), advantages normalised within each group
   (`group_advantages`);
3. each completion packed behind its prompt into a training row (`pack`: a `Rollouts` batch);
4. the loss (`grpo_loss`) of the policy's log-probs of the packed rows (`sequence_logprobs`, the training
   forward), under `jax_megamoe.training.make_train_step`.

The log-probs on both sides are one function, `token_logprobs` (`jax_megamoe.models.sampling`): the sampler's of
each token it drew, and the training forward's of the same tokens, so that on policy the ratio is 1 up to rounding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, TypeVar, get_args

import jax
import jax.numpy as jnp
import numpy as np

from jax_megamoe.models.sampling import token_logprobs
from jax_megamoe.nn import MoEAux

__all__ = [
    "LOGIT_BLOCK",
    "CausalLM",
    "GRPOConfig",
    "Normalization",
    "Behaviour",
    "RewardFn",
    "Rollouts",
    "completions",
    "group_advantages",
    "group_rewards",
    "grpo_loss",
    "masked_mean",
    "mismatch_stats",
    "pack",
    "pad_prompts",
    "routing_mismatch",
    "sequence_logprobs",
    "target_logprobs",
    "token_logprobs",
]

Problem = TypeVar("Problem")
Completion = TypeVar("Completion")

# `reward(problem, completion, stopped) -> float`: the score of one sampled completion of `problem` (whatever the
# script keeps per prompt: its answer, its test cases); `completion` as the script decodes it (token ids, text);
# `stopped`: whether the end token came within the sampling budget.
RewardFn = Callable[[Problem, Completion, bool], float]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rollouts:
    """A batch of sampled completions as training rows (a pytree of arrays, numpy or JAX).

    `tokens [R, S]` int32: each row `prompt + completion + padding` (`pack`). The other arrays are aligned with the
    targets `tokens[:, 1:]`: `mask [R, S-1]` float32, 1 at the completion's tokens (the end token included);
    `sampler_logprobs [R, S-1]`, the log-prob of each target under the policy that sampled it (the behaviour
    policy; 0 off the mask); `advantages [R]`; `reference_logprobs [R, S-1]`, a reference policy's, where the loss
    has a KL term (None otherwise); `routing [R, S, L_moe, K]`, the experts the sampler's sparse layers chose for
    each token (`generate(..., return_routing=True)`, -1 where none; None without a record), replayed by
    `sequence_logprobs`; `trainer_logprobs [R, S-1]`, the training forward's log-probs before the first update
    (`GRPOConfig(behaviour="trainer")`; None otherwise)."""

    tokens: Any
    mask: Any
    sampler_logprobs: Any
    advantages: Any
    reference_logprobs: Any = None
    routing: Any = None
    trainer_logprobs: Any = None

    def rows(self, index: Any) -> Rollouts:
        """The rows `index` (a slice, an index array) of every array."""
        return jax.tree.map(lambda x: x[index], self)


def pad_prompts(prompts: Sequence[Sequence[int]], width: int, repeat: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """`(ids [len(prompts) * repeat, width] int32, lengths [...] int32)`: the prompts' token ids right-padded with 0
    (`generate`'s `prompt_ids` and `prompt_lengths`), each repeated `repeat` times in a row (a group of samples per
    prompt). Raises ValueError for an empty prompt or one longer than `width`."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if not len(prompts) or lengths.min() < 1:
        raise ValueError("pad_prompts needs at least one prompt and no empty one")
    if lengths.max() > width:
        raise ValueError(f"a prompt of {lengths.max()} tokens exceeds width {width}: pass width {lengths.max()}")
    ids = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
    return np.repeat(ids, repeat, axis=0), np.repeat(lengths, repeat)


def pack(
    prompt_ids: np.ndarray,
    prompt_lengths: np.ndarray,
    tokens: np.ndarray,
    lengths: np.ndarray,
    logprobs: np.ndarray | None = None,
    advantages: np.ndarray | None = None,
    routing: np.ndarray | None = None,
) -> Rollouts:
    """Completions `tokens [R, N]` (the first `lengths` of each row real; `generate`'s `tokens` and `lengths`)
    behind their prompts (`prompt_ids [R, P]`, the first `prompt_lengths` real): rows of `P + N` tokens, padded with
    0. Each token keeps the position it was sampled at (`generate`'s rows start at position 0 whatever their
    prompt's length), and the padding only trails the real tokens, so the causal mask keeps it out of their
    attention. `logprobs [R, N]`: the sampler's (`generate`'s `logprobs`; None: zeros); `advantages [R]` (None:
    zeros); `routing`: `generate`'s routing record (positions prompt then completion, as the rows lay them out),
    cut or padded with -1 to the rows' width (None: no record)."""
    rows, width = prompt_ids.shape
    seq = width + tokens.shape[1]
    column = np.arange(seq)[None, :]
    start, end = prompt_lengths[:, None], (prompt_lengths + lengths)[:, None]
    completion = (column >= start) & (column < end)
    picked = np.clip(column - start, 0, tokens.shape[1] - 1)
    packed = np.where(column < start, np.pad(prompt_ids, ((0, 0), (0, seq - width))), 0)
    packed = np.where(completion, np.take_along_axis(tokens, picked, axis=1), packed).astype(np.int32)
    sampled = np.zeros((rows, seq), np.float32)
    if logprobs is not None:
        sampled = np.where(completion, np.take_along_axis(logprobs, picked, axis=1), 0).astype(np.float32)
    record = None
    if routing is not None:
        routing = np.asarray(routing)
        record = np.full((rows, seq, *routing.shape[2:]), -1, routing.dtype)
        record[:, : min(seq, routing.shape[1])] = routing[:, :seq]
    return Rollouts(
        packed,
        completion[:, 1:].astype(np.float32),
        sampled[:, 1:],
        np.zeros(rows, np.float32) if advantages is None else np.asarray(advantages, np.float32),
        routing=record,
    )


def completions(tokens: np.ndarray, lengths: np.ndarray, end_id: int) -> list[tuple[np.ndarray, bool]]:
    """Each row's `(ids before the end token, whether the end token came)`, from `generate`'s `tokens` and
    `lengths` (a row that stops emits `end_id` last)."""
    result = []
    for row, length in zip(np.asarray(tokens), np.asarray(lengths), strict=True):
        ids = row[:length]
        stopped = bool(length > 0 and ids[-1] == end_id)
        result.append((ids[:-1] if stopped else ids, stopped))
    return result


def group_rewards(
    reward: RewardFn[Problem, Completion],
    problems: Sequence[Problem],
    completions: Sequence[tuple[Completion, bool]],
    group: int,
) -> np.ndarray:
    """`[len(problems), group]` float32 rewards of `completions` (`(completion, stopped)` per row, `group` rows per
    problem in a row, as `pad_prompts` repeats them)."""
    if len(completions) != len(problems) * group:
        raise ValueError(f"{len(completions)} completions are not {group} per problem of {len(problems)}")
    scores = [reward(problems[i // group], completion, stopped) for i, (completion, stopped) in enumerate(completions)]
    return np.array(scores, np.float32).reshape(len(problems), group)


def group_advantages(rewards: np.ndarray, epsilon: float = 1e-4) -> np.ndarray:
    """GRPO's advantages: each reward less its group's mean, over the group's standard deviation plus `epsilon`
    (`[P, G]` -> `[P * G]`); a group whose samples all score alike gets zeros."""
    rewards = np.asarray(rewards, np.float32)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [prompts, group], got shape {rewards.shape}")
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    return (centred / (rewards.std(axis=1, keepdims=True) + epsilon)).reshape(-1)


# Positions per block of the LM head's logits in `target_logprobs`: a block's float32 logits [rows, block, vocab]
# are the only ones alive (recomputed in the backward), so a large vocabulary never holds [rows, seq, vocab].
LOGIT_BLOCK = 128


def target_logprobs(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, *, block: int = LOGIT_BLOCK) -> jax.Array:
    """`log_softmax(hidden @ kernel)[targets]`, float32 `[R, S]`, for `hidden [R, S, H]` and the LM head
    `kernel [H, V]`: the logits in float32 from operands in their dtype, as the model's LM head computes them,
    then the sampler's `token_logprobs`, over blocks of `block` positions, each recomputed in the backward rather
    than kept."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    rows, seq, width = hidden.shape
    block = min(seq, block)
    blocks = -(-seq // block)
    pad = blocks * block - seq
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(rows, blocks, block, width).swapaxes(0, 1)
    targets = jnp.pad(targets, ((0, 0), (0, pad))).reshape(rows, blocks, block).swapaxes(0, 1)

    @jax.checkpoint
    def one_block(carry, inputs):
        h, t = inputs
        return carry, token_logprobs(jnp.einsum("rsh,hv->rsv", h, kernel, preferred_element_type=jnp.float32), t)

    _, logprobs = jax.lax.scan(one_block, None, (hidden, targets))
    return logprobs.swapaxes(0, 1).reshape(rows, blocks * block)[:, :seq]


class CausalLM(Protocol):
    """What `sequence_logprobs` needs of a model (`jax_megamoe.models.qwen3_moe.Qwen3MoeForCausalLM` has it)."""

    def hidden_states(
        self, input_ids: jax.Array, *, routing: jax.Array | None = None, return_routing: bool = False
    ) -> tuple[jax.Array, MoEAux]: ...

    def lm_head_kernel(self) -> jax.Array: ...


def sequence_logprobs(
    model: CausalLM,
    tokens: jax.Array,
    *,
    routing: jax.Array | None = None,
    return_routing: bool = False,
    block: int = LOGIT_BLOCK,
) -> tuple[jax.Array, MoEAux]:
    """`(log-probs [R, S-1] float32 of tokens[:, 1:], each given the tokens before it; the model's MoEAux)`: the
    training forward of rows `tokens [R, S]` (e.g. `Rollouts.tokens`), its LM head in blocks (`target_logprobs`).

    `routing [R, S, L_moe, K]` (`Rollouts.routing`) replays a sampler's routing record: each sparse layer uses the
    recorded experts, weighted by this model's router (routing replay; the model's `routing=`). With
    `return_routing`, `aux.routing [R, S-1, L_moe, K]` holds the router's own choices (`routing_mismatch`)."""
    recorded = None if routing is None else routing[:, :-1]
    hidden, aux = model.hidden_states(tokens[:, :-1], routing=recorded, return_routing=return_routing)
    return target_logprobs(hidden, model.lm_head_kernel(), tokens[:, 1:], block=block), aux


def routing_mismatch(recorded: jax.Array, chosen: jax.Array) -> jax.Array:
    """The share of routing choices that differ between a sampler's record `recorded [R, S, L_moe, K]` and a
    trainer's own choices `chosen` (same shape; `sequence_logprobs(..., return_routing=True)`): over every token
    and sparse layer with a record, the experts of one not among the other's, out of K. 0 where nothing is
    recorded."""
    recorded, chosen = recorded.astype(jnp.int32), chosen.astype(jnp.int32)
    fed = jnp.any(recorded >= 0, axis=-1)  # [R, S, L_moe]
    shared = jnp.any(recorded[..., :, None] == chosen[..., None, :], axis=-1)  # each recorded expert chosen too
    differ = jnp.sum(~shared, axis=-1) / recorded.shape[-1]
    return jnp.sum(jnp.where(fed, differ, 0.0)) / jnp.maximum(jnp.sum(fed), 1)


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """The mean of `values` where `mask` is 1 (0 where the mask is empty)."""
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def mismatch_stats(logprobs: jax.Array, sampler_logprobs: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """How far `logprobs [R, S-1]` (a training forward's) lie from the sampler's `sampler_logprobs` over the tokens
    where `mask` is 1: the largest, mean and 99th-percentile |log ratio| (`log_ratio_max`, `log_ratio_mean`,
    `log_ratio_p99`) and `sampler_kl`, the k3 estimate `r - 1 - log r` of KL(pi_sampler || pi), `r` the ratio."""
    # Off the mask the log-probs are not comparable (the sampler's are 0 there): zero them before any exp.
    to_sampler = jnp.where(mask > 0, logprobs - sampler_logprobs, 0.0)
    size = jnp.abs(to_sampler)
    return {
        "log_ratio_max": jnp.max(size),
        "log_ratio_mean": masked_mean(size, mask),
        "log_ratio_p99": jnp.nanquantile(jnp.where(mask > 0, size, jnp.nan), 0.99),
        "sampler_kl": masked_mean(jnp.exp(to_sampler) - 1 - to_sampler, mask),
    }


# How the per-token losses of a batch are averaged: "token", every masked token of the batch weighs alike (long
# completions weigh more); "sequence", each row's mean over its tokens, then the mean over the rows that have any
# (GRPO's paper: each completion weighs alike).
Normalization = Literal["token", "sequence"]


# Whose log-probs the clipped ratio divides by: "sampler", the behaviour policy's as the sampler reported them
# (`Rollouts.sampler_logprobs`); "trainer", the training forward's before the first update
# (`Rollouts.trainer_logprobs`), each token weighted by the truncated importance weight
# `min(pi_trainer / pi_sampler, tis_cap)` (TIS), the sampler/trainer mismatch corrected rather than folded into
# the ratio.
Behaviour = Literal["sampler", "trainer"]


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """`grpo_loss`'s settings: the ratio's clip range `1 +- clip_epsilon`; `kl_coef`, the weight of the KL term to a
    reference policy (0: none); `normalization` of the per-token losses (`Normalization`); `behaviour`, the policy
    the ratio divides by (`Behaviour`); with "trainer", `tis_cap`, the truncation C of the importance weight
    `pi_trainer / pi_sampler` (2, as verl uses), and `mask_band`, `(low, high)`: tokens whose importance weight
    lies outside it are masked out of the loss (IcePop's / masked importance sampling's token masking; None:
    none)."""

    clip_epsilon: float = 0.2
    kl_coef: float = 0.0
    normalization: Normalization = "token"
    behaviour: Behaviour = "sampler"
    tis_cap: float = 2.0
    mask_band: tuple[float, float] | None = None

    def __post_init__(self):
        if not 0 < self.clip_epsilon < 1:
            raise ValueError(f"clip_epsilon must be in (0, 1), got {self.clip_epsilon}")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.normalization not in get_args(Normalization):
            raise ValueError(f"normalization must be one of {get_args(Normalization)}, got {self.normalization!r}")
        if self.behaviour not in get_args(Behaviour):
            raise ValueError(f"behaviour must be one of {get_args(Behaviour)}, got {self.behaviour!r}")
        if not self.tis_cap >= 1:
            raise ValueError(f"tis_cap must be >= 1, got {self.tis_cap}")
        if self.mask_band is not None:
            if self.behaviour != "trainer":
                raise ValueError('mask_band masks by the weight pi_trainer / pi_sampler: it needs behaviour="trainer"')
            low, high = self.mask_band
            if not 0 <= low < 1 < high:
                raise ValueError(f"mask_band must be (low, high) with 0 <= low < 1 < high, got {self.mask_band}")


def grpo_loss(
    logprobs: jax.Array, batch: Rollouts, config: GRPOConfig = GRPOConfig()
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO's loss of the policy's log-probs `logprobs [R, S-1]` of `batch`'s targets (`sequence_logprobs`), over the
    masked tokens: per token `-min(r * A, clip(r, 1 - eps, 1 + eps) * A)` with `r = pi / pi_behaviour` and `A` the
    row's advantage, plus `config.kl_coef` times the k3 estimate of KL(pi || pi_reference), `exp(d) - d - 1` with
    `d = log pi_reference - log pi` (where `batch.reference_logprobs` is given), averaged as `config.normalization`
    says. The behaviour policy (`config.behaviour`): the sampler's log-probs `batch.sampler_logprobs`, or the
    trainer's own before the first update, `batch.trainer_logprobs`, with each token's loss weighted by
    `w = min(pi_trainer / pi_sampler, config.tis_cap)` and, with `config.mask_band`, the tokens whose
    `pi_trainer / pi_sampler` lies outside the band masked out.

    Returns `(loss, stats)`, the statistics token means over the mask whatever the normalisation: `clip_fraction`
    (the tokens whose ratio the clip holds), `kl` (where there is a reference), and the sampler/trainer mismatch of
    `pi / pi_sampler` (at the first update of a batch the policy is still the sampler's, so these measure how far
    the sampler's log-probs are from the training forward's): `mismatch_stats`; with behaviour "trainer" also
    `tis_truncated` (the share of tokens whose weight the cap holds) and `band_masked` (the share masked out)."""
    if config.kl_coef and batch.reference_logprobs is None:
        raise ValueError(f"kl_coef={config.kl_coef} needs the batch's reference_logprobs")
    trainer = config.behaviour == "trainer"
    if trainer and batch.trainer_logprobs is None:
        raise ValueError(
            'behaviour="trainer" needs the batch\'s trainer_logprobs (the forward before the first update)'
        )
    mask = batch.mask
    behaviour = batch.trainer_logprobs if trainer else batch.sampler_logprobs
    log_ratio = jnp.where(mask > 0, logprobs - behaviour, 0.0)
    ratio = jnp.exp(log_ratio)
    advantages = batch.advantages[:, None]
    eps = config.clip_epsilon
    per_token = -jnp.minimum(ratio * advantages, jnp.clip(ratio, 1 - eps, 1 + eps) * advantages)
    was_clipped = ((ratio < 1 - eps) & (advantages < 0)) | ((ratio > 1 + eps) & (advantages > 0))
    stats = {"clip_fraction": masked_mean(was_clipped, mask), **mismatch_stats(logprobs, batch.sampler_logprobs, mask)}
    if trainer:
        weight = jnp.exp(jnp.where(mask > 0, batch.trainer_logprobs - batch.sampler_logprobs, 0.0))
        stats["tis_truncated"] = masked_mean(weight > config.tis_cap, mask)
        per_token = per_token * jnp.minimum(weight, config.tis_cap)
        if config.mask_band is not None:
            low, high = config.mask_band
            kept = (weight >= low) & (weight <= high)
            stats["band_masked"] = masked_mean(~kept, mask)
            mask = mask * kept
    if batch.reference_logprobs is not None:
        to_reference = jnp.where(mask > 0, batch.reference_logprobs - logprobs, 0.0)
        kl = jnp.exp(to_reference) - to_reference - 1
        stats["kl"] = masked_mean(kl, mask)
        per_token = per_token + config.kl_coef * kl
    if config.normalization == "token":
        return masked_mean(per_token, mask), stats
    counts = jnp.sum(mask, axis=1)
    row_means = jnp.sum(per_token * mask, axis=1) / jnp.maximum(counts, 1.0)
    return jnp.sum(row_means) / jnp.maximum(jnp.sum(counts > 0), 1), stats
