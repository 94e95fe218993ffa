"""Hugging Face safetensors <-> Qwen3-MoE parameters: file I/O and the name/layout mapping.

Our parameter paths mirror transformers' module names, so one rule maps them: path `a.b.kernel` is HF
`model.a.b.weight` transposed (torch Linear stores `[out, in]`), `.scale`/`.embedding` are `.weight` as is,
`lm_head` has no `model.` prefix, the router `mlp.router` is HF's `mlp.gate`. The experts are the
exception: ours are fused `w_gate_up [E, H, 2I]` / `w_down [E, I, H]`. The scanned model's stacks
`layer_runs.{r}.*` hold the HF layers of run r (`Qwen3MoeConfig.layer_runs`) on a leading layer axis.

Every tensor can be read in part (`read_param` with an index of slices), so a sharded load reads from the
files only the slices the local devices hold.
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
        self._file_of = weight_map or {key: SINGLE_FILE for key in self._handles[SINGLE_FILE].keys()}  # noqa: SIM118 - safetensors handles are not iterable

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The tensor `name` as a numpy array, or only its `index` (contiguous slices, one per dimension),
        read from the file without the rest; KeyError naming the tensor if absent."""
        if name not in self._file_of:
            raise KeyError(f"tensor {name!r} not found in the checkpoint")
        handle = self._handles[self._file_of[name]]
        if index is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[index]

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._file_of:
            raise KeyError(f"tensor {name!r} not found in the checkpoint")
        return tuple(self._handles[self._file_of[name]].get_slice(name).get_shape())

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


def unstacked_keys(key: tuple, config) -> list[tuple] | None:
    """The per-layer keys (`layers.{i}.*`) a scanned stack's parameter `layer_runs.{r}.*` holds, in order; None
    for a parameter that is not stacked."""
    if key[0] != "layer_runs":
        return None
    first, count, _ = config.layer_runs()[int(key[1])]
    return [("layers", first + j, *key[2:]) for j in range(count)]


def param_shape(reader: SafetensorsReader, key: tuple, config) -> tuple[int, ...]:
    """The shape our parameter `key` has in the checkpoint (read from the headers, no data)."""
    layers = unstacked_keys(key, config)
    if layers is not None:
        return (len(layers), *param_shape(reader, layers[0], config))
    if key[-1] not in ("w_gate_up", "w_down"):
        name, transposed = hf_name(key)
        shape = reader.shape(name)
        return shape[::-1] if transposed else shape
    prefix = _experts_prefix(key)
    fused = f"{prefix}.gate_up_proj" if key[-1] == "w_gate_up" else f"{prefix}.down_proj"
    if fused in reader:
        experts, a, b = reader.shape(fused)
        return experts, b, a
    if key[-1] == "w_down":
        hidden, inter = reader.shape(f"{prefix}.0.down_proj.weight")
        return config.num_experts, inter, hidden
    inter, hidden = reader.shape(f"{prefix}.0.gate_proj.weight")
    return config.num_experts, hidden, 2 * inter


def _bounds(index: tuple, shape: tuple) -> tuple[slice, ...]:
    """`index` (slices, or fewer than the dimensions) as one explicit contiguous slice per dimension."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    bounds = []
    for part, size in zip(index, shape, strict=True):
        start, stop, step = part.indices(size)
        if step != 1:
            raise ValueError(f"only contiguous slices can be read, got {part}")
        bounds.append(slice(start, stop))
    return tuple(bounds)


def read_param(reader: SafetensorsReader, key: tuple, config, index: tuple | None = None) -> np.ndarray:
    """Our parameter `key` built from the checkpoint (per-expert or fused experts layout; stacked for the
    scanned model's `layer_runs`), or only its `index` (slices of our layout), reading only that from the files."""
    index = _bounds(index or (), param_shape(reader, key, config))
    layers = unstacked_keys(key, config)
    if layers is not None:
        return np.stack(
            [read_param(reader, layers[j], config, index[1:]) for j in range(*index[0].indices(len(layers)))]
        )
    if key[-1] not in ("w_gate_up", "w_down"):
        name, transposed = hf_name(key)
        return reader.get(name, index[::-1]).T if transposed else reader.get(name, index)
    prefix = _experts_prefix(key)
    fused = f"{prefix}.gate_up_proj" if key[-1] == "w_gate_up" else f"{prefix}.down_proj"
    rows, a, b = index
    if fused in reader:  # [E, 2I, H] -> [E, H, 2I]; [E, H, I] -> [E, I, H]
        return np.swapaxes(reader.get(fused, (rows, b, a)), 1, 2)
    experts = range(*rows.indices(config.num_experts))
    if key[-1] == "w_down":
        return np.stack([reader.get(f"{prefix}.{e}.down_proj.weight", (b, a)).T for e in experts])
    inter = param_shape(reader, key, config)[-1] // 2
    gate = slice(min(b.start, inter), min(b.stop, inter))
    up = slice(max(b.start, inter) - inter, max(b.stop, inter) - inter)
    return np.stack(
        [
            np.concatenate(
                [
                    reader.get(f"{prefix}.{e}.gate_proj.weight", (gate, a)),
                    reader.get(f"{prefix}.{e}.up_proj.weight", (up, a)),
                ]
            ).T
            for e in experts
        ]
    )


def load_sharded(reader: SafetensorsReader, key: tuple, config, shape: tuple, sharding, dtype) -> jax.Array:
    """Parameter `key` as one global array with `sharding`, each local device's shard read straight from the
    files (`read_param` with the shard's index), so no process holds more of the tensor than its devices do;
    a slice several local devices share (replicated over some mesh axis) is read once."""
    shards: dict[tuple, np.ndarray] = {}

    def shard(index):
        bounds = _bounds(index, shape)
        span = tuple((b.start, b.stop) for b in bounds)
        if span not in shards:
            shards[span] = read_param(reader, key, config, bounds).astype(dtype)
        return shards[span]

    return jax.make_array_from_callback(shape, sharding, shard)


def _to_host(value: jax.Array, dtype) -> np.ndarray:
    if not value.is_fully_addressable:
        value = multihost_utils.process_allgather(value, tiled=True)
    host = np.asarray(jax.device_get(value))
    return host.astype(dtype) if dtype is not None else host


def to_hf_tensors(params: dict[tuple, jax.Array], config, dtype=None) -> Iterator[tuple[str, np.ndarray]]:
    """Yields `(HF name, array)` for our flat parameters, experts in transformers' per-expert layout; a
    scanned stack is brought to the host one layer at a time."""
    for key, value in params.items():
        layers = unstacked_keys(key, config)
        if layers is None:
            yield from _hf_tensors(key, _to_host(value, dtype))
        else:
            for j, layer_key in enumerate(layers):
                yield from _hf_tensors(layer_key, _to_host(value[j], dtype))


def _hf_tensors(key: tuple, value: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
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


def write(
    path: str | os.PathLike, config: dict, tensors: Iterator[tuple[str, np.ndarray]], max_shard_bytes: int
) -> None:
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
    shards: list[tuple[str, list]] = []
    current: dict = {}
    current_bytes = 0

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
