"""`jax_megamoe.training` on the tiny model and small arrays: AdamW's schedule and decay mask, the sharded
cross-entropy against optax's, the donated step of a loss, checkpoints that refuse another state with the array and
both shapes or dtypes, the memory plan, the FLOP count and the metrics log. (A state restored on another mesh:
tests/test_depth_checkpoint.py.)"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_megamoe import training
from jax_megamoe.models import qwen3_moe, sharding


def tiny(scan_layers=True, **config):
    """The constructor of the tiny model (float32), its config changed by `config`."""
    changed = dataclasses.replace(qwen3_moe.tiny(), **config)
    return lambda: qwen3_moe.Qwen3MoeForCausalLM(changed, dtype=jnp.float32, scan_layers=scan_layers, rngs=nnx.Rngs(0))


def test_adamw_warms_up_decays_and_spares_vectors_from_weight_decay():
    tx = training.adamw(1.0, warmup_steps=2, decay_steps=10, weight_decay=0.5, grad_clip=1e9, b1=0.0, b2=0.0)
    params = {"stack": {"layer_runs": {"scale": jnp.ones((3, 4))}}, "kernel": jnp.ones((4, 4)), "bias": jnp.ones(4)}
    state = tx.init(params)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, state = tx.update(zero, state, params)  # step 0: the learning rate is 0
    assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(updates))
    updates, state = tx.update(zero, state, params)  # step 1: lr 0.5; zero gradients leave only the decay
    np.testing.assert_allclose(updates["kernel"], -0.5 * 0.5 * params["kernel"])
    # A vector, and a stack of vectors (a scanned layer axis in front), are not decayed.
    assert float(jnp.abs(updates["bias"]).max()) == 0
    assert float(jnp.abs(updates["stack"]["layer_runs"]["scale"]).max()) == 0
    with pytest.raises(ValueError, match="learning_rate must be a finite number >= 0, got -1"):
        training.adamw(-1, warmup_steps=0, decay_steps=1, weight_decay=0, grad_clip=1)


@pytest.mark.parametrize("mesh_shape", [None, (2, 4)])
def test_cross_entropy_equals_optax_on_the_full_logits(mesh_shape):
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(8, 5, 16)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(16, 40)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 40, (8, 5)), jnp.int32)
    want = optax.softmax_cross_entropy_with_integer_labels(hidden @ kernel, labels).mean()
    mesh = training.make_mesh(*mesh_shape) if mesh_shape else None

    def loss(hidden, kernel):
        return training.cross_entropy(hidden, kernel, labels, mesh)

    got, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(hidden, kernel)
    want_grads = jax.grad(
        lambda h, k: optax.softmax_cross_entropy_with_integer_labels(h @ k, labels).mean(), argnums=(0, 1)
    )(hidden, kernel)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_train_step_donates_its_state_and_lowers_the_loss():
    create = tiny(num_hidden_layers=1)
    tx = training.adamw(1e-2, warmup_steps=0, decay_steps=10, weight_decay=0.0, grad_clip=1.0)
    graphdef, abstract = training.abstract_state(create, tx)
    assert isinstance(jax.tree.leaves(abstract)[0], jax.ShapeDtypeStruct)

    def loss_fn(params, tokens):
        model = nnx.merge(graphdef, params)
        hidden, aux = model.hidden_states(tokens[:, :-1])
        lm = training.cross_entropy(hidden, model.lm_head_kernel(), tokens[:, 1:])
        return lm, {"lm_loss": lm, "balance": aux.load_balancing_loss}

    step = training.make_train_step(loss_fn, tx)
    state = training.init_state(create, tx)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 9)), jnp.int32)
    before = jax.tree.leaves(state)[0]
    losses = []
    for _ in range(3):
        state, stats = step(state, tokens)
        losses.append(float(stats["loss"]))
    assert before.is_deleted()  # donated: its buffer holds the new state
    assert set(stats) == {"loss", "lm_loss", "balance", "grad_norm"} and float(stats["grad_norm"]) > 0
    assert losses[-1] < losses[0]


def test_checkpoints_save_restore_and_refuse_another_state(tmp_path):
    create = tiny()
    tx = training.adamw(1e-3, warmup_steps=0, decay_steps=10, weight_decay=0.1, grad_clip=1.0)
    _, abstract = training.abstract_state(create, tx)
    directory = tmp_path / "ckpt"
    checkpoints = training.Checkpoints(directory, save_every=2)
    assert checkpoints.latest_step() is None and not directory.exists()  # looking creates nothing
    state = training.init_state(create, tx)
    assert checkpoints.save(2, state) and not checkpoints.save(3, state)  # every second step
    checkpoints.wait_until_finished()
    assert checkpoints.latest_step() == 2
    restored = training.Checkpoints(directory).restore(2, abstract)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)

    deeper = training.abstract_state(tiny(num_hidden_layers=3), tx)[1]
    with pytest.raises(training.CheckpointMismatch) as error:
        checkpoints.restore(2, deeper)
    assert isinstance(error.value, ValueError)
    assert str(error.value) == (
        f"the checkpoint of step 2 in {directory} does not hold the state asked for: "
        "layer_runs.0.input_layernorm.scale is stored (2, 64), the state asks for (3, 64)"
    )
    assert error.value.stored == ((2, 64), "float32") and error.value.wanted == ((3, 64), "float32")
    bf16 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), abstract)
    with pytest.raises(
        training.CheckpointMismatch, match="embed_tokens.embedding is stored as float32, the state asks"
    ):
        checkpoints.check(2, bf16)
    _, unscanned = training.abstract_state(tiny(scan_layers=False), tx)
    with pytest.raises(training.CheckpointMismatch, match=r"scale is stored \(2, 64\), the state asks for absent"):
        checkpoints.check(2, unscanned)


def test_memory_plan_of_a_step_from_shapes_alone():
    mesh = training.make_mesh(2, 4)
    create = tiny()
    tx = training.adamw(1e-3, warmup_steps=0, decay_steps=10, weight_decay=0.1, grad_clip=1.0)
    graphdef, state = training.abstract_state(create, tx)
    shardings = sharding.tree_shardings(state, mesh, fsdp=True, expert_axis=None)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
    rows = training.batch_sharding(mesh)

    def loss_fn(params, tokens):
        hidden, _ = nnx.merge(graphdef, params).hidden_states(tokens[:, :-1])
        return jnp.mean(hidden.astype(jnp.float32) ** 2), {}

    step = training.make_train_step(loss_fn, tx, state_shardings=shardings, batch_sharding=rows)
    with jax.set_mesh(mesh):
        plan, compiled = training.plan_memory(
            step, abstract, jax.ShapeDtypeStruct((8, 17), jnp.int32, sharding=rows), program_bytes=True
        )
    sizes = plan.bytes
    assert sizes == training.memory_analysis(compiled)
    parts = sizes["arguments"] + sizes["outputs"] - sizes["aliased"] + sizes["temporaries"] + sizes["generated_code"]
    assert plan.total == parts > 0 and plan.program_bytes > 0 and plan.allocator_limit_bytes is None
    assert plan.fits(plan.total) and not plan.fits(plan.total - 1)
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    assert 0 < training.shard_bytes(state.params, shardings.params) < whole  # FSDP: a device holds a share


def test_flops_count_the_lm_head_as_the_issue_does():
    # 4 layers at Qwen3-30B-A3B width, 16384 tokens: the LM head alone is 6 * 151936 * 2048 * 16384 ~ 30.6 TFLOP.
    config = dataclasses.replace(qwen3_moe.qwen3_30b_a3b(), num_hidden_layers=4)
    assert (config.vocab_size, config.hidden_size, config.num_experts, config.num_experts_per_tok) == (
        151936,
        2048,
        128,
        8,
    )
    head = 6 * 151936 * 2048 * 16384
    attention_proj = 2048 * 128 * (2 * 32 + 2 * 4)
    moe = 2048 * 128 + 8 * 3 * 2048 * 768
    expected = 6 * 16384 * (151936 * 2048 + 4 * (attention_proj + moe)) + 6 * 4 * 4096 * 32 * 128 * 16384
    assert training.train_flops_per_token(config, 4096) * 16384 == expected
    assert head / 1e12 == pytest.approx(30.6, abs=0.1)
    assert training.peak_flops("NVIDIA H200") == training.PEAK_FLOPS["H200"]
    assert training.peak_flops("cpu") is None and training.peak_flops("cpu", 2.0) == 2e12


def test_metrics_log_appends_json_lines_and_plots_the_loss(tmp_path):
    log = training.MetricsLog(str(tmp_path / "run"), fresh=True)
    log.write({"step": 1, "lm_loss": 3.0})
    log.write({"step": 2, "lm_loss": 2.5, "eval_loss": 2.7})
    log.close()
    again = training.MetricsLog(str(tmp_path / "run"), fresh=False)
    again.write({"step": 3, "lm_loss": 2.0})
    again.close()
    records = training.read_metrics(log.path)
    assert [r["step"] for r in records] == [1, 2, 3] and records[1] == json.loads(json.dumps(records[1]))
    training.plot_loss_curves({"run": records}, str(tmp_path / "loss.png"))
    assert (tmp_path / "loss.png").stat().st_size > 0
