"""Checkpoints of the scanned model: HF safetensors mapped per layer into the stacks (both expert layouts),
loaded onto an FSDP x expert mesh slice by slice, saved back for transformers; an orbax train state saved on one
mesh restores on another and continues with the same loss."""

import hf_models
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_megamoe import training
from jax_megamoe.models import hf_checkpoint, qwen3_moe, sharding

transformers = pytest.importorskip("transformers")

# Four layers with a dense one (layer 1): stacks [0], [1], [2, 3].
HF_CONFIG = hf_models.HF_CONFIG | dict(num_hidden_layers=4, num_experts=8)
MESH = ((2, 4), ("data", "expert"))


def mesh_of(shape):
    return jax.make_mesh(shape, ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A random transformers model saved in both expert layouts: per expert (its save_pretrained) and fused."""
    model = hf_models.tiny_hf_model(0, num_hidden_layers=4, num_experts=8)
    root = tmp_path_factory.mktemp("hf")
    model.save_pretrained(root / "per_expert")
    hf_models.save_fused(model, root / "fused")
    ids = np.random.default_rng(0).integers(0, HF_CONFIG["vocab_size"], (8, 6))
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits.numpy()
    return model, root, ids, logits


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_stacks_load_per_layer_onto_an_fsdp_mesh_reading_slices(hf, layout, monkeypatch):
    _, root, ids, want = hf
    reads = []
    get = hf_checkpoint.SafetensorsReader.get

    def recording_get(self, name, index=None):
        value = get(self, name, index)
        reads.append((name, value.size, int(np.prod(self.shape(name)))))
        return value

    monkeypatch.setattr(hf_checkpoint.SafetensorsReader, "get", recording_get)
    mesh = mesh_of(MESH[0])
    model = qwen3_moe.from_pretrained(root / layout, mesh=mesh, implementation="cpu")
    assert model.layer_runs[2].mlp.w_gate_up[...].shape == (2, 8, 32, 32)
    assert model.layer_runs[2].mlp.w_gate_up[...].sharding.spec == P(None, "expert", "data", None)
    assert model.embed_tokens.embedding[...].sharding.spec == P("data", None)
    # Sharded tensors were read in slices: FSDP halves every matrix, the experts split four ways besides.
    q_reads = [(size, total) for name, size, total in reads if name == "model.layers.3.self_attn.q_proj.weight"]
    assert q_reads and all(size == total // 2 for size, total in q_reads)
    if layout == "fused":
        expert_reads = [(s, t) for n, s, t in reads if n == "model.layers.2.mlp.experts.gate_up_proj"]
        assert expert_reads and all(size == total // 8 for size, total in expert_reads)
    with jax.set_mesh(mesh):
        tokens = jax.device_put(ids, NamedSharding(mesh, P(("data", "expert"))))
        logits = nnx.jit(lambda m, x: m(x)[0])(model, tokens)
    np.testing.assert_allclose(logits, want, atol=1e-4)


def test_scanned_model_saves_per_layer_for_transformers(hf, tmp_path):
    _, root, ids, want = hf
    ours = qwen3_moe.from_pretrained(root / "per_expert")
    assert ours.scan_layers
    qwen3_moe.save_pretrained(ours, tmp_path, max_shard_bytes=40_000)
    reloaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        np.testing.assert_allclose(reloaded(torch.tensor(ids)).logits.numpy(), want, atol=1e-5)
    unrolled = qwen3_moe.from_pretrained(tmp_path, scan_layers=False)
    np.testing.assert_allclose(unrolled(jnp.asarray(ids))[0], want, atol=1e-4)


def test_orbax_checkpoint_restores_on_another_mesh_with_the_same_loss(tmp_path):
    """A train state (`jax_megamoe.training`: FSDP x expert shardings, AdamW, the sharded cross-entropy) saved
    with `Checkpoints` on a 2 x 4 mesh restores into a 4 x 2 mesh's shardings and continues with the same loss."""
    config = qwen3_moe.Qwen3MoeConfig.from_dict(HF_CONFIG | {"num_hidden_layers": 2, "mlp_only_layers": []})
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, (3, 8, 17)).astype(np.int32)

    def create():
        return qwen3_moe.Qwen3MoeForCausalLM(
            config, dtype=jnp.float32, implementation="cpu", expert_axis="expert", rngs=nnx.Rngs(0)
        )

    def setup(shape):
        mesh = training.make_mesh(*shape)
        tx = training.adamw(1e-2, warmup_steps=1, decay_steps=3, weight_decay=0.1, grad_clip=1.0)
        graphdef, abstract = training.abstract_state(create, tx)
        shardings = sharding.tree_shardings(abstract, mesh, fsdp=True, expert_axis="expert")
        rows = training.batch_sharding(mesh)

        def loss_fn(params, batch):
            model = nnx.merge(graphdef, params)
            hidden, aux = model.hidden_states(batch[:, :-1])
            lm = training.cross_entropy(hidden, model.lm_head_kernel(), batch[:, 1:], mesh)
            return lm + 0.01 * aux.load_balancing_loss, {}

        step = training.make_train_step(loss_fn, tx, state_shardings=shardings, batch_sharding=rows)

        def run(state, i):
            with jax.set_mesh(mesh):
                return step(state, training.global_batch(tokens[i], rows))

        return tx, abstract, shardings, run

    tx, abstract, shardings, run = setup((2, 4))
    state = training.init_state(create, tx, shardings)
    state, _ = run(state, 0)
    saved = training.Checkpoints(tmp_path / "ckpt")
    saved.save(1, state)
    saved.wait_until_finished()
    state, stats = run(state, 1)
    state, stats_a = run(state, 2)

    # Restored into the other mesh's shardings: data 4 x expert 2, every array resharded on the way in.
    _, _, shardings_b, run_b = setup((4, 2))
    restored = training.Checkpoints(tmp_path / "ckpt").restore(1, abstract, shardings_b)
    spec = restored.params["layer_runs"][0]["mlp"]["w_gate_up"].get_value().sharding.spec
    assert spec == P(None, "expert", "data", None)
    assert restored.params["layer_runs"][0]["mlp"]["w_gate_up"].get_value().sharding.mesh.shape["data"] == 4
    restored, stats_b1 = run_b(restored, 1)
    restored, stats_b = run_b(restored, 2)
    np.testing.assert_allclose(stats_b1["loss"], stats["loss"], rtol=1e-5)
    np.testing.assert_allclose(stats_b["loss"], stats_a["loss"], rtol=1e-5)
