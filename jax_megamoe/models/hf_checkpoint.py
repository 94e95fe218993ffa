"""Hugging Face safetensors <-> Qwen3-MoE parameters: file I/O and the name/layout mapping.

Our parameter paths mirror transformers' module names, so one rule maps them: path `a.b.kernel` is HF
`model.a.b.weight` transposed (torch Linear stores `[out, in]`), `.scale`/`.embedding` are `.weight` as is,
`lm_head` has no `model.` prefix, the router `mlp.router` is HF's `mlp.gate`. The experts are the
exception: ours are fused `w_gate_up [E, H, 2I]` / `w_down [E, I, H]`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class SafetensorsReader:
    """Reads tensors by name from a checkpoint directory: one `model.safetensors` or an index of shards."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
            weight_map = None
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        self._handles = {name: safe_open(os.path.join(path, name), framework="numpy") for name in files}
        self._file_of = weight_map or {key: SINGLE_FILE for key in self._handles[SINGLE_FILE].keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> np.ndarray:
        """The tensor `name` as a numpy array; KeyError naming the tensor if absent."""
        if name not in self._file_of:
            raise KeyError(f"tensor {name!r} not found in the checkpoint")
        return self._handles[self._file_of[name]].get_tensor(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handles.clear()


def hf_name(key: tuple) -> tuple[str, bool]:
    """HF tensor name of our parameter path `key`, and whether the tensor is transposed between the two."""
    *module, leaf = (str(k) for k in key)
    module = ["gate" if (m == "router" and i and module[i - 1] == "mlp") else m for i, m in enumerate(module)]
    prefix = "" if module[0] == "lm_head" else "model."
    return prefix + ".".join(module) + ".weight", leaf == "kernel"


def _experts_prefix(key: tuple) -> str:
    return "model." + ".".join(str(k) for k in key[:-1]) + ".experts"


def load_param(reader: SafetensorsReader, key: tuple, config) -> np.ndarray:
    """Our parameter `key` built from the checkpoint (per-expert or fused experts layout)."""
    if key[-1] not in ("w_gate_up", "w_down"):
        name, transposed = hf_name(key)
        value = reader.get(name)
        return value.T if transposed else value
    prefix = _experts_prefix(key)
    fused = f"{prefix}.gate_up_proj" if key[-1] == "w_gate_up" else f"{prefix}.down_proj"
    if fused in reader:
        return np.swapaxes(reader.get(fused), 1, 2)  # [E, 2I, H] -> [E, H, 2I]; [E, H, I] -> [E, I, H]
    experts = range(config.num_experts)
    if key[-1] == "w_down":
        return np.stack([reader.get(f"{prefix}.{e}.down_proj.weight").T for e in experts])
    return np.stack([np.concatenate([reader.get(f"{prefix}.{e}.gate_proj.weight"),
                                     reader.get(f"{prefix}.{e}.up_proj.weight")]).T for e in experts])


def place(value: np.ndarray, mesh, spec) -> jax.Array:
    """Puts a host array on the devices: sharded by `spec` over `mesh`, or on the default device."""
    if mesh is None:
        return jax.device_put(value)
    sharding = jax.sharding.NamedSharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _to_host(value: jax.Array, dtype) -> np.ndarray:
    if not value.is_fully_addressable:
        value = multihost_utils.process_allgather(value, tiled=True)
    value = np.asarray(jax.device_get(value))
    return value.astype(dtype) if dtype is not None else value


def to_hf_tensors(params: dict[tuple, jax.Array], config, dtype=None) -> Iterator[tuple[str, np.ndarray]]:
    """Yields `(HF name, array)` for our flat parameters, experts in transformers' per-expert layout."""
    for key, value in params.items():
        value = _to_host(value, dtype)
        if key[-1] == "w_gate_up":
            inter = value.shape[-1] // 2
            for e in range(value.shape[0]):
                yield f"{_experts_prefix(key)}.{e}.gate_proj.weight", np.ascontiguousarray(value[e, :, :inter].T)
                yield f"{_experts_prefix(key)}.{e}.up_proj.weight", np.ascontiguousarray(value[e, :, inter:].T)
        elif key[-1] == "w_down":
            for e in range(value.shape[0]):
                yield f"{_experts_prefix(key)}.{e}.down_proj.weight", np.ascontiguousarray(value[e].T)
        else:
            name, transposed = hf_name(key)
            yield name, np.ascontiguousarray(value.T if transposed else value)


def write(path: str | os.PathLike, config: dict, tensors: Iterator[tuple[str, np.ndarray]],
          max_shard_bytes: int) -> None:
    """Writes `config.json` and the tensors: one `model.safetensors`, or shards of at most
    `max_shard_bytes` plus `model.safetensors.index.json`. Only JAX process 0 writes."""
    if jax.process_index() != 0:
        for _ in tensors:  # still take part in the gathers of multi-process arrays
            pass
        return
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    shards, current, current_bytes = [], {}, 0

    def flush():
        name = f"model-{len(shards) + 1:05d}.safetensors.part"
        save_file(current, os.path.join(path, name), metadata={"format": "pt"})
        shards.append((name, list(current)))

    for name, value in tensors:
        if current and current_bytes + value.nbytes > max_shard_bytes:
            flush()
            current, current_bytes = {}, 0
        current[name] = value
        current_bytes += value.nbytes
    flush()
    if len(shards) == 1:
        os.replace(os.path.join(path, shards[0][0]), os.path.join(path, SINGLE_FILE))
        return
    weight_map = {}
    for i, (part, names) in enumerate(shards, start=1):
        final = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        os.replace(os.path.join(path, part), os.path.join(path, final))
        weight_map.update(dict.fromkeys(names, final))
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
