"""Qwen3-MoE model: logits parity with transformers (float32), HF checkpoint loading in both expert
layouts (single file and sharded index), save -> transformers round trip, router parity, config."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_models import HF_CONFIG, save_fused, tiny_hf_model
from moe_cases import seeded_rng

import jax_megamoe as jmm
from jax_megamoe.models import qwen3_moe

transformers = pytest.importorskip("transformers")


def token_ids(seed=0, shape=(2, 13)):
    return seeded_rng("token ids", seed).integers(0, HF_CONFIG["vocab_size"], shape)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def assert_logits_close(got, want):
    assert np.max(np.abs(np.asarray(got) - want)) < 1e-4


def test_logits_match_transformers(hf_checkpoint):
    model, path = hf_checkpoint
    ours = qwen3_moe.from_pretrained(path, implementation="cpu", scan_layers=False)  # layers to look at one by one
    assert [layer.is_moe for layer in ours.layers] == [True, False, True]
    ids = token_ids()
    logits, aux = ours(jnp.asarray(ids))
    assert_logits_close(logits, hf_logits(model, ids))
    assert aux.expert_counts.shape == (2, 4)
    assert int(aux.expert_counts.sum()) == 2 * ids.size * 2


def test_fused_expert_layout_loads(tmp_path):
    model = tiny_hf_model(seed=1)
    save_fused(model, tmp_path)
    ids = token_ids(1)
    assert_logits_close(qwen3_moe.from_pretrained(tmp_path)(jnp.asarray(ids))[0], hf_logits(model, ids))


def test_save_round_trip_through_transformers_sharded(tmp_path):
    config = qwen3_moe.Qwen3MoeConfig.from_dict(HF_CONFIG | {"tie_word_embeddings": False})
    ours = qwen3_moe.Qwen3MoeForCausalLM(config, rngs=nnx.Rngs(3))
    qwen3_moe.save_pretrained(ours, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in index["weight_map"]
    ids = token_ids(2)
    want, _ = ours(jnp.asarray(ids))
    reloaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path).eval()
    assert_logits_close(want, hf_logits(reloaded, ids))
    assert_logits_close(qwen3_moe.from_pretrained(tmp_path)(jnp.asarray(ids))[0], np.asarray(want))


def test_tied_embeddings(tmp_path):
    model = tiny_hf_model(seed=2, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    ours = qwen3_moe.from_pretrained(tmp_path)
    assert ours.lm_head is None
    ids = token_ids(3)
    assert_logits_close(ours(jnp.asarray(ids))[0], hf_logits(model, ids))


def test_router_matches_transformers():
    model = tiny_hf_model(seed=4)
    router = model.model.layers[0].mlp.gate
    hidden = torch.randn(50, HF_CONFIG["hidden_size"])
    with torch.no_grad():
        logits, scores, indices = router(hidden)
    weights, experts = jmm.route(jnp.asarray(logits.numpy()), HF_CONFIG["num_experts_per_tok"], True)
    np.testing.assert_array_equal(experts, indices.numpy())
    np.testing.assert_allclose(weights, scores.numpy(), rtol=1e-6)


def test_loads_onto_a_mesh_with_experts_sharded(hf_checkpoint):
    model, path = hf_checkpoint
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    ours = qwen3_moe.from_pretrained(path, mesh=mesh, fsdp=False, scan_layers=False)
    assert ours.layers[0].mlp.w_gate_up[...].sharding.spec == jax.sharding.PartitionSpec("expert", None, None)
    assert ours.embed_tokens.embedding[...].sharding.is_fully_replicated
    ids = token_ids(5, shape=(8, 6))
    want = hf_logits(model, ids)
    assert_logits_close(ours(jnp.asarray(ids))[0], want)
    with jax.set_mesh(mesh):  # now the MoE layers run expert-parallel (moe_ffn_ep over "expert")
        sharded_ids = jax.device_put(ids, jax.sharding.NamedSharding(mesh, jax.P(("data", "expert"))))
        assert_logits_close(nnx.jit(lambda m, x: m(x)[0])(ours, sharded_ids), want)


@pytest.mark.parametrize("save_moe", [False, True], ids=["recompute_all", "save_moe_residuals"])
def test_remat_matches(save_moe):
    config = qwen3_moe.tiny()
    policy = jax.checkpoint_policies.save_only_these_names("moe_layout", "moe_gate_up") if save_moe else None
    plain = qwen3_moe.Qwen3MoeForCausalLM(config, rngs=nnx.Rngs(0))
    remat = qwen3_moe.Qwen3MoeForCausalLM(config, remat=True, remat_policy=policy, rngs=nnx.Rngs(0))
    ids = jnp.asarray(seeded_rng("remat ids").integers(0, 256, (2, 16)))

    def loss(model):
        logits, aux = model(ids)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1)) + aux.load_balancing_loss

    grad = nnx.jit(nnx.grad(loss))
    for got, want in zip(jax.tree.leaves(grad(remat)), jax.tree.leaves(grad(plain)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_remat_recomputes_only_the_experts_gate_up_projections():
    # Under nnx.remat each decoder layer's backward recomputes its forward, but of the MoE only moe_gate_up: the
    # expert backward needs gate_up alone, and the recomputed moe_down (the layer's MoE output) is dropped.
    config = qwen3_moe.tiny()
    ids = jnp.asarray(seeded_rng("remat counts ids").integers(0, 256, (2, 16)))

    def calls(remat, remat_policy=None):
        model = qwen3_moe.Qwen3MoeForCausalLM(
            config,
            remat=remat,
            remat_policy=remat_policy,
            implementation="cpu",
            scan_layers=False,  # per-layer counts: a scan lowers each run's layer once
            rngs=nnx.Rngs(0),
        )
        graph, state = nnx.split(model)

        def loss(state):
            logits, aux = nnx.merge(graph, state)(ids)
            return jnp.mean(jax.nn.logsumexp(logits, axis=-1)) + aux.load_balancing_loss

        text = jax.jit(jax.value_and_grad(loss)).lower(state).as_text()
        return {op: text.count(f"custom_call @jmm_cpu_moe_{op}(") for op in ("gate_up", "down", "backward")}

    layers = config.num_hidden_layers
    assert calls(remat=False) == {"gate_up": layers, "down": layers, "backward": layers}
    assert calls(remat=True) == {"gate_up": 2 * layers, "down": layers, "backward": layers}
    # Saving the named residuals: nothing of the MoE is recomputed.
    policy = jax.checkpoint_policies.save_only_these_names("moe_layout", "moe_gate_up")
    assert calls(remat=True, remat_policy=policy) == {"gate_up": layers, "down": layers, "backward": layers}
    with pytest.raises(ValueError, match="remat_policy needs remat=True"):
        qwen3_moe.Qwen3MoeForCausalLM(config, remat_policy=policy, rngs=nnx.Rngs(0))


def test_config_from_dict_and_presets():
    config = qwen3_moe.Qwen3MoeConfig.from_dict(
        {
            "num_local_experts": 16,
            "rope_parameters": {"rope_theta": 7.0},
            "torch_dtype": "bfloat16",
            "num_attention_heads": 8,
            "hidden_size": 256,
            "head_dim": None,
        }
    )
    assert (config.num_experts, config.rope_theta, config.head_dim) == (16, 7.0, 32)
    assert qwen3_moe.Qwen3MoeConfig.from_dict(qwen3_moe.qwen3_30b_a3b().to_dict()) == qwen3_moe.qwen3_30b_a3b()
    big = qwen3_moe.qwen3_235b_a22b()
    assert (big.hidden_size, big.moe_intermediate_size, big.num_hidden_layers) == (4096, 1536, 94)
    hf = transformers.Qwen3MoeConfig(
        **{k: v for k, v in qwen3_moe.tiny().to_dict().items() if k not in ("architectures", "model_type")}
    )
    assert (hf.num_experts, hf.rope_parameters["rope_theta"]) == (8, 10000.0)


@pytest.mark.parametrize(
    "values, match",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_attention_heads": 6, "num_key_value_heads": 4}, "multiple"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE"),
    ],
)
def test_config_rejects_unsupported(values, match):
    with pytest.raises(ValueError, match=match):
        qwen3_moe.Qwen3MoeConfig.from_dict(values)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        qwen3_moe.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(qwen3_moe.tiny().to_dict()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        qwen3_moe.from_pretrained(tmp_path)


def test_implementation_and_transport_reach_every_moe_layer():
    config = qwen3_moe.tiny()
    model = qwen3_moe.Qwen3MoeForCausalLM(
        config,
        implementation="reference",
        transport="ragged",
        expert_axis="expert",
        scan_layers=False,
        rngs=nnx.Rngs(0),
    )
    moe_layers = [layer.mlp for layer in model.layers if layer.is_moe]
    assert moe_layers
    assert {(m.implementation, m.transport, m.expert_axis) for m in moe_layers} == {("reference", "ragged", "expert")}
    for old in ({"backend": "cpu"}, {"ep_backend": "xla"}, {"ep_workspace": None}):
        with pytest.raises(TypeError):
            qwen3_moe.Qwen3MoeForCausalLM(config, rngs=nnx.Rngs(0), **old)
