"""Routing replay: `route(..., recorded=)`, the MoE layers' and the Qwen3-MoE model's `routing=` argument, and
`generate(..., return_routing=True)`, whose record replayed in the training forward gives the sampler's routing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from generation_cases import prompts_of, sampler_and_trainer_logprobs
from hf_models import HF_CONFIG
from jax.sharding import AxisType
from moe_cases import seeded_rng

import jax_megamoe as jmm
from jax_megamoe import nn as jmnn
from jax_megamoe import reference
from jax_megamoe.models import qwen3_moe

T, H, I, E, K = 24, 16, 8, 6, 2


def logits_and_record(seed="replay"):
    rng = seeded_rng(seed)
    logits = jnp.asarray(rng.normal(size=(T, E)), jnp.float32)
    other = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int8)
    return logits, other


def test_replaying_the_own_choices_or_no_record_is_the_plain_route():
    logits, _ = logits_and_record()
    want = jmm.route(logits, K)
    for recorded in (want[1].astype(jnp.int8), jnp.full((T, K), -1, jnp.int16)):
        got = jmm.route(logits, K, recorded=recorded)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replayed_experts_take_this_routers_probabilities(norm_topk_prob):
    logits, other = logits_and_record()
    other[3] = -1  # no record: token 3 routes itself
    other[5, 1] = E  # out of range: dropped, weight 0
    weights, experts = jmm.route(logits, K, norm_topk_prob, recorded=jnp.asarray(other))
    probs = np.asarray(jax.nn.softmax(logits))
    own_w, own_e = map(np.asarray, jmm.route(logits, K, norm_topk_prob))
    for t in range(T):
        if t == 3:
            np.testing.assert_array_equal(np.asarray(experts[t]), own_e[t])
            np.testing.assert_allclose(np.asarray(weights[t]), own_w[t], rtol=1e-6)
            continue
        np.testing.assert_array_equal(np.asarray(experts[t]), other[t])
        want = np.array([probs[t, e] if 0 <= e < E else 0.0 for e in other[t]])
        if norm_topk_prob:
            want = want / want.sum()
        np.testing.assert_allclose(np.asarray(weights[t]), want, rtol=1e-6)
    assert float(weights[5, 1]) == 0.0


def test_replaying_other_experts_computes_what_the_reference_computes_with_them():
    logits, other = logits_and_record()
    rng = seeded_rng("replay weights")
    x = jnp.asarray(rng.normal(size=(T, H)), jnp.float32)
    w_gate_up = jnp.asarray(rng.normal(size=(E, H, 2 * I)) * 0.3, jnp.float32)
    w_down = jnp.asarray(rng.normal(size=(E, I, H)) * 0.3, jnp.float32)
    y, _ = jmnn.moe_block(x, logits, w_gate_up, w_down, top_k=K, implementation="cpu", recorded=jnp.asarray(other))
    probs = jax.nn.softmax(logits)
    weights = jnp.take_along_axis(probs, jnp.asarray(other, jnp.int32), axis=-1)
    want = reference.moe_ffn(x, weights / weights.sum(-1, keepdims=True), jnp.asarray(other), w_gate_up, w_down)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_the_routers_gradient_under_replay_matches_finite_differences():
    _, other = logits_and_record()
    layer = jmnn.MoE(H, I, E, K, implementation="reference", router_init=jax.nn.initializers.normal(1.0),
                     rngs=nnx.Rngs(0))  # fmt: skip
    x = jnp.asarray(seeded_rng("replay x").normal(size=(T, H)), jnp.float32)
    graphdef, params = nnx.split(layer)
    kernel = params["router"]["kernel"].get_value()

    def loss(kernel):
        state = jax.tree.map(lambda v: v, params)
        state["router"]["kernel"] = nnx.Param(kernel)
        y, _ = nnx.merge(graphdef, state)(x, jnp.asarray(other))
        return jnp.sum(jnp.sin(y))

    grad = jax.grad(loss)(kernel)
    assert float(jnp.abs(grad).max()) > 0
    rng = seeded_rng("replay directions")
    for _ in range(3):  # central differences along random directions (the record fixes the experts: smooth)
        d = jnp.asarray(rng.normal(size=kernel.shape), jnp.float32)
        eps = 1e-2
        numeric = (loss(kernel + eps * d) - loss(kernel - eps * d)) / (2 * eps)
        np.testing.assert_allclose(float(jnp.vdot(grad, d)), float(numeric), rtol=2e-2)


def test_replay_is_dropless_and_its_record_is_checked():
    layer = jmnn.MoE(H, I, E, K, capacity_factor=1.0, rngs=nnx.Rngs(0))
    x = jnp.zeros((T, H))
    with pytest.raises(ValueError, match="routing replay is dropless"):
        layer(x, jnp.zeros((T, K), jnp.int8))
    layer = jmnn.MoE(H, I, E, K, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"routing must have the tokens' shape then top_k, \(24, 2\)"):
        layer(x, jnp.zeros((T, K + 1), jnp.int8))
    with pytest.raises(TypeError, match="routing must be an integer array"):
        layer(x, jnp.zeros((T, K), jnp.float32))


# The model: HF_CONFIG's three layers are sparse, dense, sparse (two runs of the scanned model per kind).
CONFIG = qwen3_moe.Qwen3MoeConfig.from_dict(HF_CONFIG)
L_MOE = len(CONFIG.moe_layer_index())


def make_model(**options):
    return qwen3_moe.Qwen3MoeForCausalLM(CONFIG, implementation="cpu", rngs=nnx.Rngs(0), **options)


def own_routing(model, ids):
    """The experts each sparse layer of `model` chooses for `ids [B, S]`, `[B, S, L_moe, K]` (a prefill that
    records them)."""
    cache = model.init_cache(ids.shape[0], ids.shape[1], record_routing=True)
    _, cache = model.prefill(ids, jnp.full((ids.shape[0],), ids.shape[1], jnp.int32), cache)
    sparse = sorted(CONFIG.moe_layer_index())
    return jnp.moveaxis(cache.routing[np.array(sparse)], 0, 2)


def loss_and_grads(model, ids, routing):
    def loss(model):
        logits, aux = model(ids, routing=routing)
        return jnp.mean(jnp.sin(logits)) + aux.load_balancing_loss

    return nnx.value_and_grad(loss)(model)


IDS = jnp.asarray(seeded_rng("replay ids").integers(0, CONFIG.vocab_size, (2, 9)))


@pytest.mark.parametrize("options", [{}, {"scan_layers": False}, {"remat": True}], ids=["scanned", "unrolled", "remat"])
def test_the_model_replaying_its_own_choices_or_nothing_is_the_plain_forward(options):
    model = make_model(**options)
    routing = own_routing(model, IDS)
    assert routing.dtype == jnp.int8 and routing.shape == (2, 9, L_MOE, CONFIG.num_experts_per_tok)
    want_loss, want_grads = loss_and_grads(model, IDS, None)
    for record in (routing, jnp.full_like(routing, -1)):
        got_loss, got_grads = loss_and_grads(model, IDS, record)
        np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
        for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_the_model_replays_other_experts_layer_by_layer():
    """A record naming other experts changes the forward as the unrolled model's layers given them directly do,
    and each sparse layer reads its own slice of the record."""
    scanned, unrolled = make_model(), make_model(scan_layers=False)
    routing = np.asarray(own_routing(scanned, IDS)).copy()
    routing[..., 1, :] = (routing[..., 1, :] + 1) % CONFIG.num_experts  # the second sparse layer only
    routing = jnp.asarray(routing)
    got, _ = scanned(IDS, routing=routing)
    want, _ = unrolled(IDS, routing=routing)
    plain, _ = scanned(IDS)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(got - plain).max()) > 1e-3


def test_the_forward_returns_the_routers_own_choices_replayed_or_not():
    """`return_routing`: each sparse layer's own top-k, what prefill records; under a replay of other experts the
    router's choices, not the replayed experts (the trainer's side of a sampler/trainer comparison): the first
    sparse layer's inputs are unchanged by the replay, so its choices are too."""
    model = make_model()
    own = own_routing(model, IDS)
    _, aux = model(IDS, return_routing=True)
    assert aux.routing.dtype == own.dtype
    np.testing.assert_array_equal(np.asarray(aux.routing), np.asarray(own))
    other = (own + 1) % CONFIG.num_experts
    _, replayed = model(IDS, routing=other, return_routing=True)
    np.testing.assert_array_equal(np.asarray(replayed.routing[:, :, 0]), np.asarray(own[:, :, 0]))
    assert model(IDS)[1].routing is None


def test_the_models_record_is_checked_at_trace_time():
    model = make_model()
    for bad, match in (
        (jnp.zeros((2, 9, L_MOE + 1, 2), jnp.int8), r"routing must have shape \[B, T, L_moe, K\] = \(2, 9, 2, 2\)"),
        (jnp.zeros((2, 8, L_MOE, 2), jnp.int8), "for tokens of shape"),
        (jnp.zeros((2, 9, L_MOE, 2), jnp.float32), "routing must be an integer array"),
    ):
        with pytest.raises((ValueError, TypeError), match=match):
            jax.eval_shape(lambda m, r: m(IDS, routing=r), model, bad)


def test_generate_records_the_routing_of_every_fed_token_and_the_trainer_replays_it():
    model = make_model()
    prompts = prompts_of((5, 11, 3))
    new = 6
    out = qwen3_moe.generate(model, prompts, max_new_tokens=new, temperature=0, return_routing=True)
    assert qwen3_moe.generate(model, prompts, max_new_tokens=new, temperature=0).routing is None
    record = np.asarray(out.routing)
    bucket = qwen3_moe.generation_plan(model, 3, 11, new).prompt_bucket
    assert record.dtype == np.int8 and record.shape == (3, bucket + new, L_MOE, CONFIG.num_experts_per_tok)
    width = max(map(len, prompts)) + new
    rows = np.zeros((3, width), np.int32)
    for row, prompt in enumerate(prompts):
        fed = len(prompt) + int(out.lengths[row]) - 1
        assert np.all(record[row, :fed] >= 0) and np.all(record[row, fed:] == -1)
        rows[row, : len(prompt)] = prompt
        rows[row, len(prompt) : len(prompt) + new] = out.tokens[row]
    ids = jnp.asarray(rows)
    # The trainer's own routing of the fed tokens is the sampler's (float32: one model, one set of kernels) ...
    own = np.asarray(own_routing(model, ids))
    fed_mask = record[:, :width] >= 0
    np.testing.assert_array_equal(np.where(fed_mask, own, -1), record[:, :width])
    # ... so replaying the record gives the unreplayed forward and the sampler's log-probs.
    replayed, _ = model(ids, routing=jnp.asarray(record[:, :width]))
    plain, _ = model(ids)
    np.testing.assert_allclose(np.asarray(replayed), np.asarray(plain), rtol=1e-6, atol=1e-6)
    trained = qwen3_moe.token_logprobs(replayed[:, :-1], ids[:, 1:])
    for row, prompt in enumerate(prompts):
        n = int(out.lengths[row])
        got = np.asarray(trained[row, len(prompt) - 1 : len(prompt) - 1 + n])
        np.testing.assert_allclose(got, np.asarray(out.logprobs[row, :n]), atol=1e-5)


def test_sampler_and_trainer_agree_in_float32_with_and_without_replay():
    """The comparison the GPU generation test makes in bf16 (generation_cases.sampler_and_trainer_logprobs), in
    float32 on the CPU: one model, one set of kernels, so nothing is rerouted and all three log-probs agree."""
    model = make_model()
    generated, trained, replayed, rerouted = sampler_and_trainer_logprobs(
        model, prompts_of((5, 11, 3)), 6, temperature=1.0, key=jax.random.key(3)
    )
    assert generated.shape == trained.shape == replayed.shape == rerouted.shape == (3 * 6,)
    assert not np.any(rerouted)
    np.testing.assert_allclose(trained, generated, atol=1e-5)
    np.testing.assert_allclose(replayed, generated, atol=1e-5)


def test_replay_under_a_mesh_gives_the_one_device_result():
    """8 host devices, experts over an `expert` axis (moe_ffn_ep, xla transport): the replayed forward and
    gradients equal the one-device model's."""
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    model = make_model()
    ids = jnp.tile(IDS, (4, 1))
    routing = np.asarray(own_routing(model, ids)).copy()
    routing[::2, :, 0] = (routing[::2, :, 0] + 1) % CONFIG.num_experts
    routing = jnp.asarray(routing)
    want_loss, want_grads = loss_and_grads(model, ids, routing)
    rows = jax.sharding.NamedSharding(mesh, jax.P(("data", "expert")))
    with jax.set_mesh(mesh):
        sharded = make_model(expert_axis="expert")
        ids, routing = jax.device_put(ids, rows), jax.device_put(routing, rows)
        got_loss, got_grads = nnx.jit(loss_and_grads)(sharded, ids, routing)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_replay_with_the_fp8_recipe():
    model = make_model(recipe="fp8_blockwise", dtype=jnp.bfloat16)
    ids = IDS
    routing = own_routing(model, ids)
    plain, _ = model(ids)
    replayed, _ = model(ids, routing=routing)
    np.testing.assert_array_equal(np.asarray(replayed, np.float32), np.asarray(plain, np.float32))
