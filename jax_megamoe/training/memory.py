"""The memory plan of a step: XLA's per-device memory analysis of the compiled program, from shapes alone (nothing
allocated), and the bytes a device holds of a sharded state. On host CPU devices standing in for GPUs the figures
are XLA:CPU's, so estimates; a GPU's own compilation is the figure to trust."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp

ANALYSIS_FIELDS = ("arguments", "outputs", "aliased", "temporaries", "generated_code")


def memory_analysis(compiled: Any) -> dict[str, int]:
    """XLA's per-device memory analysis of a compiled program (`jax.jit(f).lower(...).compile()`), in bytes, with
    the `total` a device must hold: arguments + outputs - aliased (donated buffers reused for outputs) +
    temporaries + generated code."""
    analysis = compiled.memory_analysis()
    fields = {
        "arguments": analysis.argument_size_in_bytes,
        "outputs": analysis.output_size_in_bytes,
        "aliased": analysis.alias_size_in_bytes,
        "temporaries": analysis.temp_size_in_bytes,
        "generated_code": analysis.generated_code_size_in_bytes,
    }
    fields["total"] = (
        fields["arguments"] + fields["outputs"] - fields["aliased"] + fields["temporaries"] + fields["generated_code"]
    )
    return fields


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """A compiled step's memory plan: `bytes`, `memory_analysis`'s per-device fields and total; the seconds it took
    to lower and to compile; the allocator's limit on the first device (None where the platform reports none, e.g.
    host CPUs); and the size of the lowered program's text, where asked for."""

    bytes: dict[str, int]
    lower_s: float
    compile_s: float
    allocator_limit_bytes: int | None
    program_bytes: int | None = None

    @property
    def total(self) -> int:
        return self.bytes["total"]

    def fits(self, budget_bytes: float) -> bool:
        """Whether the total fits `budget_bytes` and the allocator's limit."""
        limit = self.allocator_limit_bytes
        return self.total <= budget_bytes and (limit is None or self.total <= limit)


def plan_memory(jitted: Any, *args: Any, program_bytes: bool = False) -> tuple[MemoryPlan, Any]:
    """`(plan, compiled)`: `jitted` (a `jax.jit` function) lowered for `args` and compiled, where `args` may be
    `jax.ShapeDtypeStruct`s carrying shardings, so that nothing is allocated. Run under the mesh (`jax.set_mesh`)
    the step runs under. `program_bytes`: also measure the lowered program's text (which takes a while for a large
    one)."""
    began = time.perf_counter()
    lowered = jitted.lower(*args)
    lower_s = time.perf_counter() - began
    compiled = lowered.compile()
    compile_s = time.perf_counter() - began - lower_s
    size = len(lowered.as_text()) if program_bytes else None
    return MemoryPlan(memory_analysis(compiled), lower_s, compile_s, allocator_limit_bytes(), size), compiled


def allocator_limit_bytes(device: jax.Device | None = None) -> int | None:
    """What the platform's allocator hands out on `device` (default: the first), where it says (GPUs do:
    `XLA_PYTHON_CLIENT_MEM_FRACTION` of the memory); None on host CPUs."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return None
    return (device.memory_stats() or {}).get("bytes_limit")


def peak_memory_bytes(device: jax.Device | None = None) -> int | None:
    """Peak bytes in use on `device` (default: the first local one), where the platform reports it (GPUs do)."""
    stats = (device or jax.local_devices()[0]).memory_stats()
    return stats.get("peak_bytes_in_use") if stats else None


def shard_bytes(abstract: Any, shardings: Any) -> int:
    """Bytes one device holds of the arrays `abstract` (shapes and dtypes) laid out by `shardings` (a tree like
    it)."""

    def nbytes(x, s):
        return math.prod(s.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize

    return sum(jax.tree.leaves(jax.tree.map(nbytes, abstract, shardings)))
