"""Full-depth Qwen3-MoE machinery on CPU: the scanned model equals the unrolled one (loss and gradients), FSDP x
expert-parallel meshes give the one-device loss and gradients, the sharding rules, the chunked attention, and
HF checkpoints mapped per layer into the stacks (both expert layouts, sliced loading onto a mesh)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_megamoe.models import qwen3_moe, sharding

# Six layers, a dense one among them (layer 2) and the sparse step of 1: runs [0, 1] sparse, [2] dense, [3, 4, 5]
# sparse, so the scanned model has three stacks.
CONFIG = dataclasses.replace(
    qwen3_moe.tiny(),
    num_hidden_layers=6,
    mlp_only_layers=(2,),
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    head_dim=8,
)
# The meshes' test: a dense layer then a sparse one (two stacks), to keep eight compilations small.
MESH_CONFIG = dataclasses.replace(CONFIG, num_hidden_layers=2, mlp_only_layers=(0,))
SAVE_MOE = jax.checkpoint_policies.save_only_these_names("moe_layout", "moe_gate_up")


def ids(shape=(8, 12), seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CONFIG.vocab_size, shape))


def loss_and_grads(graphdef, state, tokens):
    def loss(state):
        logits, aux = nnx.merge(graphdef, state)(tokens)
        lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
        return jnp.mean(lse) + 0.1 * aux.load_balancing_loss + 0.01 * aux.router_z_loss, aux.expert_counts

    (value, counts), grads = jax.value_and_grad(loss, has_aux=True)(state)
    return value, grads, counts


def stacked(state_unrolled):
    """The unrolled model's flat parameters regrouped as the scanned model's stacks (by layer_runs)."""
    flat = dict(nnx.to_flat_state(state_unrolled))
    out = {}
    for r, (first, count, _) in enumerate(CONFIG.layer_runs()):
        for key in {k[2:] for k in flat if k[0] == "layers" and k[1] == first}:
            out[("layer_runs", r, *key)] = np.stack(
                [np.asarray(flat[("layers", first + j, *key)].get_value()) for j in range(count)]
            )
    out.update({k: np.asarray(v.get_value()) for k, v in flat.items() if k[0] != "layers"})
    return out


def flat_values(state):
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(state)}


def assert_trees_close(got: dict, want: dict, rtol=1e-5):
    assert got.keys() == want.keys()
    for key, value in want.items():
        scale = np.max(np.abs(value)) or 1.0  # relative to the tensor's scale: gradients cross zero
        np.testing.assert_allclose(got[key], value, rtol=rtol, atol=rtol * scale, err_msg=str(key))


def test_layer_runs_and_stacked_shapes():
    assert CONFIG.layer_runs() == ((0, 2, True), (2, 1, False), (3, 3, True))
    assert qwen3_moe.qwen3_235b_a22b().layer_runs() == ((0, 94, True),)
    step2 = dataclasses.replace(CONFIG, mlp_only_layers=(), decoder_sparse_step=2)
    assert step2.layer_runs() == tuple((i, 1, i % 2 == 1) for i in range(6))
    model = nnx.eval_shape(lambda: qwen3_moe.Qwen3MoeForCausalLM(CONFIG, expert_axis="expert", rngs=nnx.Rngs(0)))
    assert model.layer_runs[2].mlp.w_gate_up.shape == (3, 8, 32, 32)
    assert model.layer_runs[1].mlp.down_proj.kernel.shape == (1, 48, 32)
    assert nnx.get_partition_spec(nnx.state(model)).layer_runs[0].mlp.w_down.get_value() == P(
        None, "expert", None, None
    )


def test_scanned_matches_unrolled():
    # Per-layer remat saving the MoE residuals, as the full-depth runs train; the meshes' test runs without.
    kwargs = dict(implementation="cpu", remat=True, remat_policy=SAVE_MOE)
    scanned = qwen3_moe.Qwen3MoeForCausalLM(CONFIG, scan_layers=True, rngs=nnx.Rngs(0), **kwargs)
    unrolled = qwen3_moe.Qwen3MoeForCausalLM(CONFIG, scan_layers=False, rngs=nnx.Rngs(0), **kwargs)
    # Same rngs, same parameters: the stacks hold the unrolled layers.
    assert_trees_close(flat_values(nnx.state(scanned, nnx.Param)), stacked(nnx.state(unrolled, nnx.Param)), rtol=0)

    step = jax.jit(loss_and_grads, static_argnums=0)
    loss_s, grads_s, counts_s = step(*nnx.split(scanned), ids())
    loss_u, grads_u, counts_u = step(*nnx.split(unrolled), ids())
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-5)
    assert_trees_close(flat_values(grads_s), stacked(grads_u))
    assert counts_s.shape == (5, CONFIG.num_experts)  # the sparse layers in layer order
    np.testing.assert_array_equal(counts_s, counts_u)


def test_scanned_program_does_not_grow_with_depth():
    def program_size(layers):
        config = dataclasses.replace(CONFIG, num_hidden_layers=layers, mlp_only_layers=())
        graphdef, state = nnx.split(
            nnx.eval_shape(
                lambda: qwen3_moe.Qwen3MoeForCausalLM(config, implementation="cpu", remat=True, rngs=nnx.Rngs(0))
            )
        )
        return len(jax.jit(loss_and_grads, static_argnums=0).lower(graphdef, state, ids()).as_text())

    # Only the stacked shapes' digits change with depth.
    assert abs(program_size(16) - program_size(2)) < 0.01 * program_size(2)


MESHES = [(1, 8, False), (2, 4, False), (4, 2, False), (8, 1, False), (2, 4, True)]


@pytest.fixture(scope="module")
def one_device_reference():
    model = qwen3_moe.Qwen3MoeForCausalLM(MESH_CONFIG, implementation="cpu", expert_axis="expert", rngs=nnx.Rngs(1))
    graphdef, state = nnx.split(model)
    return graphdef, state, jax.jit(loss_and_grads, static_argnums=0)(graphdef, state, ids())


@pytest.mark.parametrize("scan_layers", [True, False])
def test_backward_keeps_no_float32_activations(scan_layers, capsys):
    # Inside the layer scan every residual is a stacked buffer: the norms, RoPE and the router's input are
    # recomputed from their bf16 inputs in the backward instead of keeping float32 copies of the activations.
    model = qwen3_moe.Qwen3MoeForCausalLM(
        CONFIG, dtype=jnp.bfloat16, implementation="cpu", scan_layers=scan_layers, rngs=nnx.Rngs(0)
    )
    graphdef, state = nnx.split(model)
    tokens = ids()
    batch, seq = tokens.shape
    heads, kv_heads, head_dim = CONFIG.num_attention_heads, CONFIG.num_key_value_heads, CONFIG.head_dim
    hidden = CONFIG.hidden_size
    activations = {
        (batch, seq, hidden),
        (batch * seq, hidden),
        (batch, seq, heads, head_dim),
        (batch, seq, kv_heads, head_dim),
    }

    def loss(state):
        logits, aux = nnx.merge(graphdef, state)(tokens)
        return jnp.mean(logits.astype(jnp.float32)) + aux.load_balancing_loss

    jax.ad_checkpoint.print_saved_residuals(loss, state)
    saved = capsys.readouterr().out.splitlines()
    assert any(line.startswith("bf16[") for line in saved)  # the bf16 activations are what is kept
    shapes = [tuple(int(d) for d in line.split("[", 1)[1].split("]", 1)[0].split(",") if d) for line in saved]
    kept = [
        line
        for line, shape in zip(saved, shapes, strict=True)
        if line.startswith("f32[") and any(shape[-len(a) :] == a for a in activations)
    ]
    assert not kept, kept


@pytest.mark.parametrize(
    "data, expert, over_expert",
    MESHES,
    ids=[f"data{d}x_expert{e}" + ("_fsdp_over_expert" if o else "") for d, e, o in MESHES],
)
def test_fsdp_expert_parallel_matches_one_device(data, expert, over_expert, one_device_reference):
    graphdef, state, (want_loss, want_grads, want_counts) = one_device_reference
    shape = (data, expert)
    mesh = jax.make_mesh(shape, ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    shardings = sharding.tree_shardings(state, mesh, fsdp=True, fsdp_over_expert=over_expert)
    specs = {k: v.get_value().spec for k, v in nnx.to_flat_state(shardings)}
    if over_expert:  # the non-expert matrices over every device
        assert specs[("layer_runs", 0, "self_attn", "k_proj", "kernel")] == P(None, ("data", "expert"), None)
        assert specs[("embed_tokens", "embedding")] == P(("data", "expert"), None)
    elif shape[0] > 1:  # FSDP: matrices over data, experts over expert (when it has more than one device)
        assert specs[("layer_runs", 0, "self_attn", "k_proj", "kernel")] == P(None, "data", None)
        assert specs[("layer_runs", 0, "mlp", "down_proj", "kernel")] == P(None, "data", None)
        assert specs[("layer_runs", 1, "mlp", "w_gate_up")] == P(None, "expert" if shape[1] > 1 else None, "data", None)
        assert specs[("embed_tokens", "embedding")] == P("data", None)
    assert specs[("norm", "scale")] == P(None)
    with jax.set_mesh(mesh):
        tokens = jax.device_put(ids(), NamedSharding(mesh, P(("data", "expert"))))
        loss, grads, counts = jax.jit(loss_and_grads, static_argnums=0, out_shardings=(None, shardings, None))(
            graphdef, jax.device_put(state, shardings), tokens
        )
    assert (
        grads["layer_runs"][1]["mlp"]["w_gate_up"].get_value().sharding.spec
        == specs[("layer_runs", 1, "mlp", "w_gate_up")]
    )
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_array_equal(counts, want_counts)
    assert_trees_close(flat_values(grads), flat_values(want_grads))


def test_sharding_rules():
    mesh = {"data": 4, "expert": 8}
    spec = sharding.param_spec
    assert spec(("layer_runs", 0, "mlp", "w_gate_up"), (48, 128, 2048, 1536), mesh, fsdp=True) == P(
        None, "expert", "data", None
    )
    assert spec(("layer_runs", 0, "mlp", "w_down"), (48, 128, 768, 2048), mesh, fsdp=True) == P(
        None, "expert", None, "data"
    )
    assert spec(("layers", 3, "mlp", "w_down"), (128, 768, 2048), mesh, fsdp=False) == P("expert", None, None)
    assert spec(("lm_head", "kernel"), (2048, 151936), mesh, fsdp=True) == P(None, "data")
    assert spec(("layer_runs", 0, "mlp", "router", "kernel"), (48, 2048, 128), mesh, fsdp=True) == P(None, "data", None)
    assert spec(("layer_runs", 0, "input_layernorm", "scale"), (48, 2048), mesh, fsdp=True) == P(None, None)
    assert spec(("embed_tokens", "embedding"), (151936, 2048), {"data": 3}, fsdp=True) == P(
        None, None
    )  # 3 divides neither
    assert spec(("lm_head", "kernel"), (2048, 151936), mesh, fsdp=True, fsdp_over_expert=True) == P(
        None, ("data", "expert")
    )
    assert spec(("layer_runs", 0, "mlp", "w_down"), (48, 128, 768, 2048), mesh, fsdp=True, fsdp_over_expert=True) == P(
        None, "expert", None, "data"
    )
    # The optimizer's moments take their parameter's sharding; step counts stay whole.
    params = {"lm_head": {"kernel": jax.ShapeDtypeStruct((64, 96), jnp.float32)}}
    import optax

    opt = jax.eval_shape(optax.adamw(1e-3).init, params)
    mesh8 = jax.make_mesh((8, 1), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    specs = sharding.tree_specs(opt, mesh8, fsdp=True)
    assert specs[0].mu["lm_head"]["kernel"] == P(None, "data") and specs[0].count == P()


def test_chunked_attention_matches_dot_product_attention():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 24, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 24, 2, 8)), jnp.float32) for _ in range(2))
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(jax.jit(qwen3_moe.chunked_attention)(q, k, v), want, rtol=1e-5, atol=1e-6)
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(qwen3_moe.chunked_attention(*a, block=6))), argnums=(0, 1, 2)))
    want_grad = jax.jit(
        jax.grad(lambda *a: jnp.sum(jnp.sin(jax.nn.dot_product_attention(*a, is_causal=True))), argnums=(0, 1, 2))
    )
    for got, ref in zip(grad(q, k, v), want_grad(q, k, v), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
