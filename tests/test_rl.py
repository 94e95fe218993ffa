"""`jax_megamoe.rl` on small cases: prompts padded and completions packed behind them at their sampled positions,
rewards and advantages per group, GRPO's loss (the clip, the KL term, both normalisations) and its gradients, the
LM head's log-probs in blocks, and the training forward's log-probs of `generate`'s samples equal to the sampler's
in float32."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_megamoe import rl
from jax_megamoe.models import qwen3_moe


def test_pad_prompts_repeats_each_prompt_for_its_group():
    ids, lengths = rl.pad_prompts([[7, 8], [9, 10, 11]], width=4, repeat=2)
    np.testing.assert_array_equal(ids, [[7, 8, 0, 0], [7, 8, 0, 0], [9, 10, 11, 0], [9, 10, 11, 0]])
    np.testing.assert_array_equal(lengths, [2, 2, 3, 3])
    assert ids.dtype == lengths.dtype == np.int32
    with pytest.raises(ValueError, match="a prompt of 3 tokens exceeds width 2: pass width 3"):
        rl.pad_prompts([[1], [1, 2, 3]], width=2)
    with pytest.raises(ValueError, match="no empty one"):
        rl.pad_prompts([[1], []], width=2)


def test_pack_puts_each_completion_behind_its_prompt_at_the_sampled_positions():
    prompt_ids, prompt_lengths = rl.pad_prompts([[97, 98], [99, 100, 101]], width=4)
    tokens = np.array([[1, 2, 3], [4, 5, 0]], np.int32)  # row 1 stopped after two tokens (padding after)
    lengths = np.array([3, 2], np.int32)
    logprobs = np.array([[-0.1, -0.2, -0.3], [-0.4, -0.5, 0.0]], np.float32)
    packed = rl.pack(prompt_ids, prompt_lengths, tokens, lengths, logprobs, np.array([1.0, -1.0]))
    np.testing.assert_array_equal(packed.tokens, [[97, 98, 1, 2, 3, 0, 0], [99, 100, 101, 4, 5, 0, 0]])
    # targets are tokens[:, 1:]: the completion's first token is predicted from the prompt's last
    np.testing.assert_array_equal(packed.mask, [[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0]])
    np.testing.assert_allclose(packed.sampler_logprobs, [[0, -0.1, -0.2, -0.3, 0, 0], [0, 0, -0.4, -0.5, 0, 0]])
    np.testing.assert_array_equal(packed.advantages, [1.0, -1.0])
    assert packed.reference_logprobs is None
    np.testing.assert_array_equal(packed.rows(slice(1, 2)).tokens, packed.tokens[1:])


def test_completions_end_at_the_end_token_and_rewards_come_per_group():
    tokens = np.array([[52, 50, 10, 0], [52, 50, 51, 53], [10, 0, 0, 0]])
    done = rl.completions(tokens, np.array([3, 4, 1]), end_id=10)
    want = [([52, 50], True), ([52, 50, 51, 53], False), ([], True)]
    assert [(ids.tolist(), stopped) for ids, stopped in done] == want

    def reward(problem: int, completion: np.ndarray, stopped: bool) -> float:
        return float(stopped) + problem * len(completion)

    rewards = rl.group_rewards(reward, [10, 100], [*done, (np.zeros(0), False)], group=2)
    np.testing.assert_array_equal(rewards, [[21, 40], [1, 0]])
    with pytest.raises(ValueError, match="not 2 per problem of 2"):
        rl.group_rewards(reward, [10, 100], done, group=2)


def test_group_advantages_are_normalised_within_each_group():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.2, 0.4, 0.6]], np.float32)
    advantages = rl.group_advantages(rewards).reshape(3, 4)
    np.testing.assert_allclose(advantages.mean(axis=1), 0, atol=1e-6)
    np.testing.assert_allclose(advantages[0], [1, -1, -1, 1], atol=1e-3)
    np.testing.assert_array_equal(advantages[1], 0)  # nothing to learn from a group that scores alike
    np.testing.assert_allclose(advantages[2].std(), 1, atol=1e-3)


def batch(logprobs, advantages, mask, reference=None):
    return rl.Rollouts(
        tokens=np.zeros(mask.shape, np.int32),
        mask=mask,
        sampler_logprobs=logprobs,
        advantages=advantages,
        reference_logprobs=reference,
    )


SAMPLED = np.array([[-1.0, -2.0, -3.0], [-1.5, -0.5, -9.0]], np.float32)
MASK = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
ADVANTAGES = np.array([2.0, -1.0], np.float32)


def test_grpo_loss_clips_the_ratio_and_penalises_the_kl():
    config = rl.GRPOConfig(clip_epsilon=0.2, kl_coef=0.1)

    def loss(lp, b):
        return rl.grpo_loss(lp, b, config)

    # At the sampler's log-probs: ratio 1, the loss is minus the token-mean advantage, nothing clipped.
    value, stats = rl.grpo_loss(jnp.asarray(SAMPLED), batch(SAMPLED, ADVANTAGES, MASK), rl.GRPOConfig())
    assert float(value) == pytest.approx(-(2 * 2 - 1 * 3) / 5)
    assert float(stats["clip_fraction"]) == 0 and float(stats["log_ratio_max"]) == 0 and "kl" not in stats

    # Off the mask anything goes (the sampler writes 0 there): no overflow into the loss.
    moved = SAMPLED.copy()
    moved[0, 2] = -1e4
    moved[0, 0] += 0.5  # ratio e^0.5 > 1.2 with a positive advantage: clipped, no gradient
    moved[1, 0] += 0.5  # the same ratio with a negative advantage: not clipped
    reference = batch(SAMPLED, ADVANTAGES, MASK, reference=moved)  # KL 0 at the moved log-probs
    value, stats = loss(jnp.asarray(moved), reference)
    assert np.isfinite(float(value)) and float(stats["clip_fraction"]) == pytest.approx(1 / 5)
    assert float(stats["log_ratio_max"]) == pytest.approx(0.5) and float(stats["kl"]) == 0
    grad = jax.grad(lambda lp: loss(lp, reference)[0])(jnp.asarray(moved))
    assert float(grad[0, 0]) == 0 and float(grad[0, 2]) == 0
    assert float(grad[0, 1]) == pytest.approx(-2 / 5) and float(grad[1, 0]) == pytest.approx(np.exp(0.5) / 5)

    # The KL term: k3's exp(d) - d - 1 per token, d = log pi_ref - log pi, weighed by kl_coef.
    _, stats = loss(jnp.asarray(SAMPLED), batch(SAMPLED, ADVANTAGES, MASK, reference=SAMPLED - 0.3))
    assert float(stats["kl"]) == pytest.approx(np.exp(-0.3) + 0.3 - 1, rel=1e-5)
    on_policy = rl.grpo_loss(jnp.asarray(SAMPLED), batch(SAMPLED, ADVANTAGES, MASK), rl.GRPOConfig())[0]
    penalised = loss(jnp.asarray(SAMPLED), batch(SAMPLED, ADVANTAGES, MASK, reference=SAMPLED - 0.3))[0]
    assert float(penalised - on_policy) == pytest.approx(0.1 * (np.exp(-0.3) + 0.3 - 1), abs=1e-6)
    with pytest.raises(ValueError, match="kl_coef=0.1 needs the batch's reference_logprobs"):
        loss(jnp.asarray(SAMPLED), batch(SAMPLED, ADVANTAGES, MASK))


def test_grpo_normalisations_weigh_tokens_or_sequences_alike():
    """On policy each token's loss is minus its row's advantage: "token" averages the 5 masked tokens, "sequence"
    the rows' means (an empty row left out)."""
    mask = np.concatenate([MASK, np.zeros((1, 3), np.float32)])
    rows = batch(np.concatenate([SAMPLED, SAMPLED[:1]]), np.array([2.0, -1.0, 7.0], np.float32), mask)
    token, _ = rl.grpo_loss(jnp.asarray(rows.sampler_logprobs), rows, rl.GRPOConfig(normalization="token"))
    sequence, _ = rl.grpo_loss(jnp.asarray(rows.sampler_logprobs), rows, rl.GRPOConfig(normalization="sequence"))
    assert float(token) == pytest.approx(-(2 * 2 - 1 * 3) / 5)
    assert float(sequence) == pytest.approx(-(2 - 1) / 2)


def test_the_trainer_as_behaviour_policy_with_truncated_importance_weights_and_a_mask_band():
    """behaviour="trainer": the ratio divides by the trainer's log-probs before the update, each token weighted by
    min(pi_trainer / pi_sampler, C); the band masks tokens by that weight. Hand-computed on five tokens."""
    trainer = SAMPLED + np.array([[1.0, -0.1, 0.0], [0.3, 0.0, 5.0]], np.float32)  # weights e^1, e^-0.1, e^0.3, 1
    rows = dataclasses.replace(batch(SAMPLED, ADVANTAGES, MASK), trainer_logprobs=trainer)
    config = rl.GRPOConfig(behaviour="trainer", tis_cap=2.0)
    value, stats = rl.grpo_loss(jnp.asarray(trainer), rows, config)  # on the trainer's policy: ratio 1
    weights = [min(np.exp(1.0), 2.0), np.exp(-0.1), np.exp(0.3), 1.0]
    want = -(2 * weights[0] + 2 * weights[1] - weights[2] - weights[3] - 1.0 * min(np.exp(5.0), 2.0)) / 5
    assert float(value) == pytest.approx(want, rel=1e-5)
    assert float(stats["tis_truncated"]) == pytest.approx(2 / 5)  # e^1 and e^5 above the cap
    assert float(stats["clip_fraction"]) == 0
    # The mismatch statistics are of pi / pi_sampler whatever the behaviour: here log ratios 1, -0.1, 0.3, 0, 5.
    assert float(stats["log_ratio_max"]) == pytest.approx(5.0)
    d = np.array([1.0, -0.1, 0.3, 0.0, 5.0])
    assert float(stats["sampler_kl"]) == pytest.approx(np.mean(np.exp(d) - 1 - d), rel=1e-5)
    banded = rl.GRPOConfig(behaviour="trainer", tis_cap=2.0, mask_band=(0.5, 2.0))
    value, stats = rl.grpo_loss(jnp.asarray(trainer), rows, banded)  # e^1 and e^5 out of the band
    kept = [(2, weights[1]), (-1, weights[2]), (-1, weights[3])]
    assert float(value) == pytest.approx(-sum(a * w for a, w in kept) / 3, rel=1e-5)
    assert float(stats["band_masked"]) == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="needs the batch's trainer_logprobs"):
        rl.grpo_loss(jnp.asarray(trainer), batch(SAMPLED, ADVANTAGES, MASK), config)


def test_routing_mismatch_counts_the_recorded_experts_the_trainer_did_not_choose():
    recorded = np.array([[[[0, 1]], [[2, 3]], [[-1, -1]]]], np.int8)  # [R=1, S=3, L=1, K=2]; the last unfed
    chosen = np.array([[[[1, 0]], [[2, 5]], [[4, 4]]]], np.int32)  # same set; one of two differs; not counted
    assert float(rl.routing_mismatch(jnp.asarray(recorded), jnp.asarray(chosen))) == pytest.approx(0.25)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(clip_epsilon=0.0), "clip_epsilon must be in"),
        (dict(kl_coef=-1.0), "kl_coef must be >= 0"),
        (dict(normalization="batch"), "normalization must be one of"),
        (dict(behaviour="reference"), "behaviour must be one of"),
        (dict(behaviour="trainer", tis_cap=0.5), "tis_cap must be >= 1"),
        (dict(mask_band=(0.5, 2.0)), 'it needs behaviour="trainer"'),
        (dict(behaviour="trainer", mask_band=(1.5, 2.0)), "0 <= low < 1 < high"),
    ],
)
def test_grpo_config_refuses_what_it_cannot_mean(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rl.GRPOConfig(**kwargs)


def _full(hidden, kernel, targets):
    return jnp.take_along_axis(jax.nn.log_softmax(hidden @ kernel), targets[..., None], axis=-1)[..., 0]


def test_target_logprobs_in_blocks_equal_the_full_log_softmax():
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(3, 10, 8)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(8, 50)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 50, (3, 10)), jnp.int32)
    want = _full(hidden, kernel, targets)
    blocked = lambda h, k, t: rl.target_logprobs(h, k, t, block=4)  # noqa: E731  (two full blocks, a padded one)
    np.testing.assert_allclose(blocked(hidden, kernel, targets), want, rtol=1e-6, atol=1e-6)
    grads = [jax.grad(lambda k, f=f: f(hidden, k, targets).sum())(kernel) for f in (blocked, _full)]
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-5)


def test_training_forward_logprobs_of_packed_samples_are_the_samplers():
    """float32: `sequence_logprobs` of `generate`'s samples packed behind their prompts gives the sampler's
    log-probs at the masked tokens (ratio 1 on policy), and the loss's |log ratio| statistics say so."""
    model = qwen3_moe.Qwen3MoeForCausalLM(qwen3_moe.tiny(), dtype=jnp.float32, rngs=nnx.Rngs(0))
    ids, lengths = rl.pad_prompts([[1, 2, 3], [4, 5], [6]], width=4, repeat=2)
    out = qwen3_moe.generate(
        model, ids, prompt_lengths=lengths, max_new_tokens=5, temperature=1.0, eos_token_id=10, key=jax.random.key(0)
    )
    packed = rl.pack(ids, lengths, *map(np.asarray, (out.tokens, out.lengths, out.logprobs)), np.ones(6))
    logprobs, _ = nnx.jit(rl.sequence_logprobs)(model, jnp.asarray(packed.tokens))
    assert packed.mask.sum() == np.asarray(out.lengths).sum()
    np.testing.assert_allclose(logprobs * packed.mask, packed.sampler_logprobs, atol=1e-5)
    _, stats = rl.grpo_loss(logprobs, dataclasses.replace(packed, tokens=jnp.asarray(packed.tokens)))
    assert float(stats["log_ratio_max"]) <= 1e-5


def test_packed_routing_replayed_gives_the_samplers_log_probs_and_no_mismatch():
    """The sampler's routing record packed with the rows, replayed by `sequence_logprobs`: the sampler's log-probs
    (float32), and the trainer's own choices equal the record (no routing mismatch in float32)."""
    model = qwen3_moe.Qwen3MoeForCausalLM(qwen3_moe.tiny(), dtype=jnp.float32, rngs=nnx.Rngs(0))
    ids, lengths = rl.pad_prompts([[1, 2, 3], [4, 5]], width=4, repeat=2)
    out = qwen3_moe.generate(
        model, ids, prompt_lengths=lengths, max_new_tokens=5, temperature=1.0, key=jax.random.key(1),
        return_routing=True,
    )  # fmt: skip
    packed = rl.pack(ids, lengths, *map(np.asarray, (out.tokens, out.lengths, out.logprobs)), np.ones(4),
                     routing=np.asarray(out.routing))  # fmt: skip
    assert packed.routing.shape == (4, 9, *out.routing.shape[2:]) and packed.routing.dtype == out.routing.dtype
    tokens, routing = jnp.asarray(packed.tokens), jnp.asarray(packed.routing)
    logprobs, aux = nnx.jit(lambda m, t, r: rl.sequence_logprobs(m, t, routing=r, return_routing=True))(
        model, tokens, routing
    )
    np.testing.assert_allclose(logprobs * packed.mask, packed.sampler_logprobs, atol=1e-5)
    assert float(rl.routing_mismatch(routing[:, :-1], aux.routing)) == 0
