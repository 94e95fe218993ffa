"""jax_megamoe inside tunix (`jax_megamoe.integrations.tunix`): the model adapter's log-probs and the gradients of
tunix's GRPO loss against tunix's own Qwen3 on one Hugging Face checkpoint (float32), the two settings where
tunix's Qwen3 parts from transformers (ours follows transformers), the rollout engine's tokens, eos, pad and
log-prob conventions, `update_params`, meshes (`with mesh:` and `jax.set_mesh`, 8 host devices with an expert
axis), bad input, and the example (examples/tunix_grpo_qwen3_moe.py) raising a reward with `GRPOLearner`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from hf_models import tiny_hf_model
from moe_cases import seeded_rng

from jax_megamoe.models import hf_checkpoint, qwen3_moe

pytest.importorskip("transformers")
pytest.importorskip("tunix")
from tunix.models.qwen3 import model as tunix_qwen3  # noqa: E402  (after the skip)
from tunix.models.qwen3 import params as tunix_params  # noqa: E402
from tunix.rl import algo_core, common  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

from jax_megamoe.integrations import tunix as megamoe  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tunix_grpo_qwen3_moe.py"
# Where tunix's Qwen3 is right: the RoPE base it always uses, top-k weights renormalised; every layer sparse (tunix's
# Qwen3 has no dense layers between sparse ones).
TUNIX_SETTINGS = dict(
    mlp_only_layers=[], num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
)
PAD, VOCAB = 0, 64
AUTO = (jax.sharding.AxisType.Auto,) * 2


def checkpoint(tmp_path_factory, **overrides):
    """`(transformers model, its save_pretrained directory)` of a tiny random Qwen3-MoE."""
    model = tiny_hf_model(**(TUNIX_SETTINGS | overrides))
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def tunix_checkpoint(tmp_path_factory):
    return checkpoint(tmp_path_factory)


def tunix_model(path) -> tunix_qwen3.Qwen3:
    """tunix's own Qwen3 on the checkpoint in `path`, float32."""
    config = qwen3_moe.Qwen3MoeConfig.from_json(path)
    tunix_config = tunix_qwen3.ModelConfig(
        num_layers=config.num_hidden_layers,
        vocab_size=config.vocab_size,
        embed_dim=config.hidden_size,
        hidden_dim=config.moe_intermediate_size,
        num_heads=config.num_attention_heads,
        head_dim=config.head_dim,
        num_kv_heads=config.num_key_value_heads,
        rope_theta=int(config.rope_theta),
        norm_eps=config.rms_norm_eps,
        use_tied_embedding=config.tie_word_embeddings,
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
    )
    return tunix_params.create_model_from_safe_tensors(str(path), tunix_config, dtype=jnp.float32)


def padded_batch(seed=0, padding=True):
    """tunix's layout: prompts `[4, 6]` left-padded, completions `[4, 10]` right-padded with PAD (ids from 1)."""
    rng = seeded_rng("tunix batch", seed)
    prompts, completions = rng.integers(1, VOCAB, (4, 6)), rng.integers(1, VOCAB, (4, 10))
    if padding:
        for row, (p, c) in enumerate([(6, 10), (3, 5), (1, 10), (4, 2)]):
            prompts[row, : 6 - p] = PAD
            completions[row, c:] = PAD
    return jnp.asarray(prompts, jnp.int32), jnp.asarray(completions, jnp.int32)


def logps(model, prompts, completions, temperature=1.0):
    return common.compute_per_token_logps(
        *nnx.split(model), prompts, completions, pad_id=PAD, eos_id=1, temperature=temperature
    )


def tunix_grads_as_hf(grads, config) -> dict[str, np.ndarray]:
    """tunix Qwen3 parameters (or their gradients) under transformers' names and layouts."""
    hidden = config.hidden_size
    out = {}
    for key, variable in nnx.to_flat_state(grads):
        name, value = ".".join(map(str, key)), np.asarray(variable.get_value())
        layer = re.match(r"layers\.(\d+)\.(.*)", name)
        prefix = f"model.layers.{layer.group(1)}." if layer else ""
        rest = layer.group(2) if layer else name
        if rest in ("attn.q_proj.w", "attn.k_proj.w", "attn.v_proj.w"):
            out[prefix + f"self_attn.{rest[5:11]}.weight"] = value.reshape(hidden, -1).T
        elif rest == "attn.o_proj.w":
            out[prefix + "self_attn.o_proj.weight"] = value.reshape(-1, hidden).T
        elif rest in ("attn.q_norm.w", "attn.k_norm.w"):
            out[prefix + f"self_attn.{rest[5:11]}.weight"] = value
        elif rest in ("input_layernorm.w", "post_attention_layernorm.w"):
            out[prefix + rest[:-1] + "weight"] = value
        elif rest == "mlp.router.kernel":
            out[prefix + "mlp.gate.weight"] = value.T
        elif rest in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            for expert in range(value.shape[0]):
                out[prefix + f"mlp.experts.{expert}.{rest[4:]}.weight"] = value[expert].T
        elif name == "lm_head.w":
            out["lm_head.weight"] = value.T
        else:
            out[
                {"embedder.input_embedding": "model.embed_tokens.weight", "final_norm.w": "model.norm.weight"}[name]
            ] = value
    return out


def ours_as_hf(grads, config) -> dict[str, np.ndarray]:
    """The adapter's parameters (or gradients; paths under `model`) under transformers' names and layouts."""
    flat = {key[1:]: variable.get_value() for key, variable in nnx.to_flat_state(grads)}
    return dict(hf_checkpoint.to_hf_tensors(flat, config))


def test_logprobs_and_grpo_gradients_match_tunix_qwen3(tunix_checkpoint):
    _, path = tunix_checkpoint
    ours, theirs = megamoe.from_pretrained(path), tunix_model(path)
    prompts, completions = padded_batch()
    mask = np.asarray(completions != PAD)
    np.testing.assert_allclose(
        np.asarray(logps(ours, prompts, completions)) * mask, np.asarray(logps(theirs, prompts, completions)) * mask,
        atol=5e-5, rtol=0,
    )  # fmt: skip
    # The gradients of tunix's GRPO loss (clipped ratio, KL to a reference, its aggregation) for both models.
    rng = seeded_rng("tunix loss", 0)
    example = common.TrainExample(
        prompt_ids=prompts,
        prompt_mask=prompts != PAD,
        completion_ids=completions,
        completion_mask=jnp.asarray(mask),
        advantages=jnp.asarray(rng.normal(size=4), jnp.float32),
        ref_per_token_logps=logps(theirs, prompts, completions) + jnp.asarray(rng.normal(size=mask.shape) * 0.1),
        old_per_token_logps=None,
    )
    config = grpo_learner.GRPOConfig(num_generations=2, beta=0.04)
    config.temperature = 1.0  # GRPOLearner sets it from the rollout config

    def loss(model):
        return algo_core.grpo_loss_fn(model, example, config, pad_id=PAD, eos_id=1)[0]

    model_config = ours.config
    got = ours_as_hf(nnx.jit(nnx.grad(loss))(ours), model_config)
    want = tunix_grads_as_hf(nnx.jit(nnx.grad(loss))(theirs), model_config)
    assert got.keys() == want.keys()
    largest = max(float(np.max(np.abs(want[name]))) for name in want)
    assert largest > 1e-3  # the gradients are not all vanishing
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=5e-5, rtol=0, err_msg=name)


@pytest.mark.parametrize(
    "overrides",
    [
        {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},  # tunix applies 1e6 whatever the config
        {"norm_topk_prob": False},  # tunix renormalises the top-k weights whatever the config
    ],
    ids=["rope_theta_500", "no_topk_renormalisation"],
)
def test_where_tunix_qwen3_parts_from_transformers_ours_does_not(tmp_path_factory, overrides):
    hf, path = checkpoint(tmp_path_factory, **overrides)
    prompts, completions = padded_batch(padding=False)
    sequences = np.concatenate([prompts, completions], axis=1)
    with torch.no_grad():
        logits = hf(torch.tensor(sequences)).logits[:, prompts.shape[1] - 1 : -1].double()
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(np.asarray(completions))[..., None])[..., 0].numpy()
    ours = np.asarray(logps(megamoe.from_pretrained(path), prompts, completions))
    theirs = np.asarray(logps(tunix_model(path), prompts, completions))
    assert np.max(np.abs(ours - want)) < 5e-5
    assert np.max(np.abs(theirs - want)) > 1e-2  # docs/tunix.md quotes this comparison


def test_adapter_refuses_what_it_cannot_run(tunix_checkpoint):
    model = megamoe.from_pretrained(tunix_checkpoint[1])
    prompts, completions = padded_batch()
    tokens, positions, mask, segments = common.process_ids(prompts, completions, PAD, 1)
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch, length, length\] = \[4, 16, 16\]"):
        model(tokens, positions=positions, attention_mask=mask[:, -1:, :], segment_ids=segments)
    with pytest.raises(ValueError, match="without a KV cache"):
        model(tokens, positions=positions, cache={"layer_0": {}}, attention_mask=mask)
    with pytest.raises(ValueError, match="sequence packing"):
        model(tokens, positions=positions, segment_ids=segments)
    with pytest.raises(ValueError, match="positions must be"):
        model(tokens, positions=positions[:, :5], attention_mask=mask)
    with pytest.raises(TypeError, match="wraps a jax_megamoe Qwen3MoeForCausalLM"):
        megamoe.TunixQwen3Moe(tunix_model(tunix_checkpoint[1]))
    # The mask's last row is the non-pad keys: the same log-probs as tunix's mask; all-true keys differ.
    logits, cache = model(tokens, positions=positions, attention_mask=mask, segment_ids=segments)
    unmasked, _ = model(tokens, positions=positions)
    assert cache is None and logits.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(logits - unmasked))) > 1e-3


class IdTokenizer:
    """Text of space-separated token ids, with the given eos and pad ids (None: the tokenizer has none)."""

    def __init__(self, eos: int | None = 1, pad: int | None = PAD):
        self.eos, self.pad = eos, pad

    def encode(self, text, **kwargs):
        return [int(t) for t in text.split()]

    def decode(self, ids, **kwargs):
        return " ".join(map(str, ids))

    def bos_id(self):
        return None

    def eos_id(self):
        return self.eos

    def pad_id(self):
        return self.pad


PROMPTS = ["5 9 12 33", "7", "40 41 42", "3 3 8 1 2", "60 2", "11 17 19"]


def config_of(**kwargs) -> base_rollout.RolloutConfig:
    return base_rollout.RolloutConfig(**({"max_tokens_to_generate": 8, "max_prompt_length": 4} | kwargs))


@pytest.fixture(scope="module")
def greedy_run(tunix_checkpoint):
    """The model, `generate`'s greedy tokens for PROMPTS (no stop token), an eos id that row 0 first emits at its
    third token or later, and a pad id that no row emits."""
    model = megamoe.from_pretrained(tunix_checkpoint[1])
    prompts = [[int(t) for t in p.split()] for p in PROMPTS]
    tokens = np.asarray(qwen3_moe.generate(model.model, prompts, max_new_tokens=8, temperature=0).tokens)
    eos = int(next(token for t, token in enumerate(tokens[0]) if t >= 2 and token not in tokens[0, :t]))
    pad = next(t for t in range(1, VOCAB) if t not in tokens and all(t not in p for p in prompts))
    return model, tokens, eos, pad


def test_rollout_stops_before_the_first_eos_and_pads_as_tunix_expects(greedy_run):
    model, tokens, eos, pad = greedy_run
    rollout = megamoe.MegaMoeRollout(model, IdTokenizer(eos=eos, pad=pad), rollout_config=config_of())
    out = rollout.generate(PROMPTS, config_of(temperature=0.0))
    for row, completion in enumerate(out.tokens):
        stops = np.flatnonzero(tokens[row] == eos)
        np.testing.assert_array_equal(completion, tokens[row, : stops[0] if stops.size else 8])
    stop = int(np.flatnonzero(tokens[0] == eos)[0])
    assert 2 <= out.tokens[0].size == stop and out.text[0] == " ".join(map(str, tokens[0, :stop]))
    # What GRPOLearner builds from them: completions right-padded, its mask `tokens != pad_id` exactly the sampled.
    padded = np.stack([np.pad(t, (0, 8 - t.size), constant_values=rollout.pad_id()) for t in out.tokens])
    np.testing.assert_array_equal((padded != pad).sum(1), [t.size for t in out.tokens])
    # Prompts left-padded with the pad id to max_prompt_length, widened to a power of two past the longest.
    assert out.left_padded_prompt_tokens.shape == (6, 8)
    np.testing.assert_array_equal(out.left_padded_prompt_tokens[1], [pad] * 7 + [7])
    assert rollout.eos_id() == eos and rollout.pad_id() == pad and rollout.model() is model


def reference_logprobs(model, prompts, completions, temperature):
    """`log_softmax(logits / T)` of each completion token from the model's own forward over prompt then completion
    (right-padded, positions from 0)."""
    rows = [[int(t) for t in p.split()] + c.tolist() for p, c in zip(prompts, completions, strict=True)]
    ids = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for row, sequence in enumerate(rows):
        ids[row, : len(sequence)] = sequence
    logits = np.asarray(nnx.jit(lambda m, ids: m(ids)[0])(model.model, jnp.asarray(ids)), np.float32) / temperature
    out = []
    for row, completion in enumerate(completions):
        start = len(rows[row]) - completion.size - 1
        scaled = jnp.asarray(logits[row, start : start + completion.size])
        out.append(np.asarray(qwen3_moe.token_logprobs(scaled, jnp.asarray(completion))))
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_rollout_logprobs_are_tunix_log_softmax_of_logits_over_t(greedy_run, temperature):
    model, _, eos, pad = greedy_run
    rollout = megamoe.MegaMoeRollout(model, IdTokenizer(eos=eos, pad=pad), rollout_config=config_of())
    settings = config_of(temperature=temperature, return_logprobs=True, top_k=5, seed=3)  # top-k: not in log-probs
    out = rollout.generate(PROMPTS, settings)
    want = reference_logprobs(model, PROMPTS, out.tokens, temperature or 1.0)
    for got, expected in zip(out.logprobs, want, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)
    if temperature == 0.7:  # not ours at temperature 1
        at_one = reference_logprobs(model, PROMPTS, out.tokens, 1.0)
        assert max(np.max(np.abs(a - b)) for a, b in zip(at_one, want, strict=True)) > 1e-2


def test_get_per_token_logps_divide_by_the_train_temperature(greedy_run):
    model, _, eos, pad = greedy_run
    rollout = megamoe.MegaMoeRollout(model, IdTokenizer(eos=eos, pad=pad), rollout_config=config_of(temperature=0.7))
    out = rollout.generate(PROMPTS, config_of(temperature=0.7, return_logprobs=True))
    padded = np.stack([np.pad(t, (0, 8 - t.size), constant_values=pad) for t in out.tokens])
    got = np.asarray(rollout.get_per_token_logps(jnp.asarray(out.left_padded_prompt_tokens), jnp.asarray(padded)))
    for row, expected in enumerate(out.logprobs):
        np.testing.assert_allclose(got[row, : expected.size], expected, atol=1e-5)


def test_update_params_shares_the_trainers_arrays_and_copies_only_into_another_model(greedy_run, tunix_checkpoint):
    model, _, eos, pad = greedy_run
    rollout = megamoe.MegaMoeRollout(model, IdTokenizer(eos=eos, pad=pad))
    before = jax.tree.leaves(nnx.state(model, nnx.Param))
    rollout.update_params(nnx.state(model, nnx.Param), (nnx.Param,))
    assert all(a is b for a, b in zip(before, jax.tree.leaves(nnx.state(model, nnx.Param)), strict=True))
    # A rollout on its own copy takes the trainer's values into its own arrays.
    own = megamoe.from_pretrained(tunix_checkpoint[1])
    separate = megamoe.MegaMoeRollout(own, IdTokenizer(eos=eos, pad=pad))
    trained = jax.tree.map(lambda x: x + 1, nnx.state(model, nnx.Param))
    separate.update_params(trained, (nnx.Param,))
    for got, want in zip(jax.tree.leaves(nnx.state(own, nnx.Param)), jax.tree.leaves(trained), strict=True):
        assert got is not want
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="parameters of another model"):
        separate.update_params(nnx.state(tunix_model(tunix_checkpoint[1]), nnx.Param), (nnx.Param,))


def test_bad_input_is_refused_before_anything_runs(greedy_run):
    model, _, eos, pad = greedy_run
    mesh = jax.make_mesh((1, 1), ("data", "expert"), axis_types=AUTO)
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={role: mesh for role in rl_cluster_lib.Role},
        rollout_engine=megamoe.MegaMoeRollout,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.adam(1e-3), eval_every_n_steps=10, max_steps=1
        ),
        rollout_config=config_of(),
    )
    with pytest.raises(ValueError, match="the tokenizer has no pad id"):
        rl_cluster_lib.RLCluster(actor=model, tokenizer=IdTokenizer(eos=eos, pad=None), cluster_config=cluster_config)
    with pytest.raises(ValueError, match="pad id 70 is outside the model's vocabulary"):
        megamoe.MegaMoeRollout(model, IdTokenizer(eos=eos, pad=70))
    rollout = megamoe.MegaMoeRollout(model, IdTokenizer(eos=eos, pad=pad))
    with pytest.raises(ValueError, match=f"prompt 1 .* holds the pad id {pad} at token 1"):
        rollout.generate(["7", f"7 {pad}"], config_of())
    with pytest.raises(ValueError, match="prompt 0 .* encodes to no tokens"):
        rollout.generate([" "], config_of())
    with pytest.raises(TypeError, match="the actor must be a TunixQwen3Moe"):
        megamoe.MegaMoeRollout(model.model, IdTokenizer())
    with pytest.raises(ValueError, match="meshes with Auto axes"):
        megamoe.MegaMoeRollout(model, IdTokenizer(), mesh=jax.make_mesh((1, 1), ("data", "expert")))


def test_with_mesh_and_set_mesh_run_the_experts_expert_parallel(tunix_checkpoint, greedy_run):
    _, path = tunix_checkpoint
    one_device, greedy, eos, pad = greedy_run
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=AUTO)
    model = megamoe.from_pretrained(path, mesh=mesh)
    prompts, completions = padded_batch()
    want = logps(one_device, prompts, completions)
    for context in (mesh, jax.set_mesh(mesh)):  # tunix's `with mesh:`, then jax_megamoe's
        with context:
            args = (*nnx.split(model), prompts, completions)
            compiled = common.compute_per_token_logps.lower(*args, pad_id=PAD, eos_id=1).compile()
            np.testing.assert_allclose(compiled(*args), want, atol=1e-5)
        assert "all-to-all" in compiled.as_text()  # the tokens go to their experts' devices
    # The rollout under the mesh: 6 prompts (rows split over 8 devices) sample the one-device greedy tokens.
    rollout = megamoe.MegaMoeRollout(model, IdTokenizer(eos=eos, pad=pad), mesh=mesh, rollout_config=config_of())
    out = rollout.generate(PROMPTS, config_of(temperature=0.0))
    for row, completion in enumerate(out.tokens):
        np.testing.assert_array_equal(completion, greedy[row, : completion.size])
    assert out.tokens[0].size == int(np.flatnonzero(greedy[0] == eos)[0])


def test_tunix_makes_its_optimizer_under_with_mesh_for_a_model_made_under_set_mesh(tunix_checkpoint):
    """flax shards the variables of a model made under `jax.set_mesh` eagerly, and so each optimizer state made from
    them, over the mesh of the moment; tunix makes its optimizer under `with mesh:`, where flax sees none. The
    adapter records each parameter's mesh, so the optimizer state is sharded as its parameter."""
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=AUTO)
    config = qwen3_moe.Qwen3MoeConfig.from_json(tunix_checkpoint[1])
    with jax.set_mesh(mesh):
        model = qwen3_moe.Qwen3MoeForCausalLM(config, expert_axis="expert", rngs=nnx.Rngs(0))
    with mesh, pytest.raises(ValueError, match="An auto mesh context or metadata is required"):
        nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    actor = megamoe.TunixQwen3Moe(model)
    with mesh:
        optimizer = nnx.Optimizer(actor, optax.adam(1e-3), wrt=nnx.Param)
    moment = optimizer.opt_state[0].mu["model"]["layer_runs"][0]["mlp"]["w_down"][...]
    assert moment.sharding.is_equivalent_to(model.layer_runs[0].mlp.w_down[...].sharding, moment.ndim)
    assert moment.sharding.spec == jax.sharding.PartitionSpec(None, "expert", None, None)


def test_example_raises_the_reward_with_grpo_learner(tmp_path):
    """examples/tunix_grpo_qwen3_moe.py as a user runs it, on a random `tiny` preset directory and two host devices
    (the experts over both, trained under tunix's `with mesh:`): the mean reward of its steps rises from <= 0.3 to
    >= 0.8 within 60 s of GRPO."""
    model = qwen3_moe.Qwen3MoeForCausalLM(qwen3_moe.tiny(), rngs=nnx.Rngs(0))
    qwen3_moe.save_pretrained(model, tmp_path)
    env = os.environ | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), str(tmp_path), "--steps", "20"], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rewards = [float(r) for r in re.findall(r"^step \d+: mean reward ([\d.]+)$", result.stdout, re.M)]
    seconds = float(re.search(r"in 20 steps, ([\d.]+) s$", result.stdout, re.M).group(1))
    assert len(rewards) == 20 and rewards[0] <= 0.3 and rewards[-1] >= 0.8, rewards
    assert seconds <= 60, (seconds, time.perf_counter() - started)
