"""Hugging Face checkpoints of the Qwen3-MoE model: `from_pretrained` (straight into shards under a mesh) and
`save_pretrained` (a directory transformers reads). The tensor names and layouts are `hf_checkpoint`'s."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from jax_megamoe.models import hf_checkpoint, sharding
from jax_megamoe.models.qwen3_moe_config import Qwen3MoeConfig
from jax_megamoe.models.qwen3_moe_model import Qwen3MoeForCausalLM


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    mesh=None,
    expert_axis: str | None = None,
    fsdp: bool = True,
    fsdp_over_expert: bool = False,
    **model_kwargs,
) -> Qwen3MoeForCausalLM:
    """Loads a Hugging Face Qwen3-MoE checkpoint directory (`config.json` + safetensors).

    Reads a single `model.safetensors` or a sharded `model.safetensors.index.json`, with experts stored
    per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`) or fused (`mlp.experts.gate_up_proj
    [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`). With `mesh`, every parameter is created directly in its
    shards (`jax_megamoe.models.sharding`: experts over `expert_axis`, default "expert" when the mesh has that
    axis; with `fsdp`, every matrix over "data" too), each process reading from the files only the slices its
    devices hold, one tensor at a time: no host or device ever holds a replicated copy of the model.

    Args:
      path: checkpoint directory.
      dtype: compute dtype. param_dtype: storage dtype (default: `dtype`).
      mesh: optional `jax.sharding.Mesh`. expert_axis: mesh axis of the experts.
      fsdp: with `mesh`, shard the parameters over its "data" axis as well (ignored without one).
      fsdp_over_expert: with `fsdp`, shard the non-expert matrices over "data" x `expert_axis` (every device).
      **model_kwargs: other `Qwen3MoeForCausalLM` arguments (implementation, remat, scan_layers, ...).
    """
    config = Qwen3MoeConfig.from_json(path)
    if mesh is not None and expert_axis is None and "expert" in mesh.axis_names:
        expert_axis = "expert"
    param_dtype = param_dtype or dtype
    abstract = nnx.eval_shape(
        lambda: Qwen3MoeForCausalLM(
            config, dtype=dtype, param_dtype=param_dtype, expert_axis=expert_axis, rngs=nnx.Rngs(0), **model_kwargs
        )
    )
    graphdef, state = nnx.split(abstract)
    specs = (
        dict(
            nnx.to_flat_state(
                sharding.tree_specs(state, mesh, fsdp=fsdp, expert_axis=expert_axis, fsdp_over_expert=fsdp_over_expert)
            )
        )
        if mesh is not None
        else {}
    )
    with hf_checkpoint.SafetensorsReader(path) as reader:
        for key, variable in nnx.to_flat_state(state):
            expected = variable.get_value().shape
            shape = hf_checkpoint.param_shape(reader, key, config)
            if shape != expected:
                raise ValueError(
                    f"checkpoint tensor for {'.'.join(map(str, key))} has shape {shape}, the config implies {expected}"
                )
            if mesh is None:
                value = jax.device_put(hf_checkpoint.read_param(reader, key, config).astype(param_dtype))
            else:
                value = hf_checkpoint.load_sharded(
                    reader, key, config, shape, jax.sharding.NamedSharding(mesh, specs[key].get_value()), param_dtype
                )
            variable.set_value(value)
    return nnx.merge(graphdef, state)


def save_pretrained(
    model: Qwen3MoeForCausalLM, path: str | os.PathLike, *, max_shard_bytes: int = 5 << 30, dtype=None
) -> None:
    """Writes `config.json` and safetensors (per-expert layout, sharded past `max_shard_bytes` with an
    index) that transformers' `Qwen3MoeForCausalLM.from_pretrained` reads. `dtype` casts on the way out
    (default: the parameters' dtype). Under multi-process JAX, process 0 writes."""
    state = nnx.state(model, nnx.Param)
    params = {key: variable.get_value() for key, variable in nnx.to_flat_state(state)}
    hf_checkpoint.write(
        path, model.config.to_dict(), hf_checkpoint.to_hf_tensors(params, model.config, dtype), max_shard_bytes
    )
