"""What the CUDA calls of moe_ffn carry, lowered for the CUDA platform on a CPU machine (nothing runs): the
trailing uint8 workspace result sized by the target's own `_ext.<target>_workspace_bytes` query (what lets XLA
capture the calls into CUDA graphs), the GEMM tiles of a `GemmConfig` as int64 attributes (each call only the
ones it uses), the backward's dz written over its gate_up operand. tests/test_moe_gpu.py runs the real
handlers, captured; tests/test_gemm_tiles_gpu.py every tile configuration."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

import jax_megamoe as jmm
from jax_megamoe import _ffi, _targets
from jax_megamoe.ops import moe as moe_ops
from jax_megamoe.ops.gemm_config import GemmConfig, GemmTiles

T, H, I, E, K = 24, 16, 8, 4, 2
BYTES = {
    "jmm_cuda_moe_layout": 1001,
    "jmm_cuda_moe_gate_up": 2003,
    "jmm_cuda_moe_down": 2503,
    "jmm_cuda_moe_backward": 3005,
}


class StandInExtension:
    """The CUDA build's workspace queries, answering a distinct size per target and recording what each was
    asked; every query named in _targets.py must exist (a missing one fails the lowering)."""

    with_cuda = True

    def __init__(self):
        self.asked = {}
        for target in _targets.all_targets():
            if target.workspace_query:
                setattr(self, target.workspace_query, self._query(target.name))

    def _query(self, name):
        def query(*sizes):
            self.asked[name] = sizes
            return BYTES.get(name, 4096)

        return query


@pytest.fixture
def cuda_lowering(monkeypatch):
    """Lowering for CUDA here: the stand-in extension, and implementation "cuda" accepted at trace time (on a
    GPU machine; here only the lowering's platform is CUDA)."""
    ext = StandInExtension()
    monkeypatch.setattr(_ffi, "extension", lambda: ext)
    monkeypatch.setattr(moe_ops, "resolve_implementation", lambda implementation, arrays=(): "cuda")
    return ext


def lowered_cuda_step(dtype, gemm_config=None) -> str:
    def loss(x, weights, experts, w_gate_up, w_down):
        y = jmm.moe_ffn(x, weights, experts, w_gate_up, w_down, implementation="cuda", gemm_config=gemm_config)
        return jnp.sum(y.astype(jnp.float32))

    args = (
        jnp.zeros((T, H), dtype),
        jnp.zeros((T, K), jnp.float32),
        jnp.zeros((T, K), jnp.int32),
        jnp.zeros((E, H, 2 * I), dtype),
        jnp.zeros((E, I, H), dtype),
    )
    grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 3, 4)))  # the value keeps y (moe_down) in
    return grads.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def calls(text: str) -> dict[str, str]:
    """Target -> its one custom-call line."""
    found = {}
    for line in text.splitlines():
        match = re.search(r"stablehlo\.custom_call @(jmm_\w+)\(", line)
        if match:
            assert match.group(1) not in found, f"{match.group(1)} called twice"
            found[match.group(1)] = line
    return found


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_every_cuda_moe_call_has_its_workspace_result(dtype, cuda_lowering):
    text = lowered_cuda_step(dtype)
    bf16 = dtype == jnp.bfloat16
    sizes = (bf16, T, K, H, I, E)
    assert cuda_lowering.asked == {
        "jmm_cuda_moe_layout": (T * K, E),
        "jmm_cuda_moe_gate_up": sizes,
        "jmm_cuda_moe_down": sizes,
        "jmm_cuda_moe_backward": sizes,
    }
    found = calls(text)
    assert sorted(found) == sorted(BYTES)
    for name, line in found.items():
        results = re.search(r"-> \((.*)\)$", line).group(1)
        assert results.split(", ")[-1] == f"tensor<{BYTES[name]}xui8>", (name, results)


def tile_attributes(line: str) -> dict[str, int]:
    return {name: int(value) for name, value in re.findall(r"(\w+_tiles) = (-?\d+) : i64", line)}


@pytest.mark.parametrize("explicit", [False, True], ids=["heuristic", "explicit"])
def test_the_gemm_config_reaches_each_call_as_int64_attributes(explicit, cuda_lowering):
    """Each GEMM call takes exactly the tiles of its GEMMs (gate_up: fwd_gate_up, down: fwd_down, backward:
    bwd_down and bwd_gate_up; the layout none), with the values of the config: the heuristic's by default, or an
    explicit one's."""
    heuristic = GemmConfig.for_problem(T, K, H, I, E)
    tiles = list(GemmTiles)
    config = GemmConfig(*(tiles[i % len(tiles)] for i in range(1, 5))) if explicit else heuristic
    found = calls(lowered_cuda_step(jnp.bfloat16, config if explicit else None))
    assert tile_attributes(found["jmm_cuda_moe_layout"]) == {}
    assert tile_attributes(found["jmm_cuda_moe_gate_up"]) == {"fwd_gate_up_tiles": int(config.fwd_gate_up)}
    assert tile_attributes(found["jmm_cuda_moe_down"]) == {"fwd_down_tiles": int(config.fwd_down)}
    assert tile_attributes(found["jmm_cuda_moe_backward"]) == {
        "bwd_down_tiles": int(config.bwd_down),
        "bwd_gate_up_tiles": int(config.bwd_gate_up),
    }


def test_gemm_config_is_typed():
    assert isinstance(GemmConfig.for_problem(16384, 8, 2048, 768, 128), GemmConfig)
    assert all(isinstance(t, GemmTiles) for t in dataclasses.astuple(GemmConfig.for_problem(64, 2, 64, 32, 8)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        GemmConfig.for_problem(64, 2, 64, 32, 8).fwd_down = next(iter(GemmTiles))
    with pytest.raises(TypeError, match="GemmTiles"):
        GemmConfig(0, 0, 0, 0)
    with pytest.raises(TypeError, match="GemmTiles"):
        GemmConfig(*(["coop"] * 4))
    assert jmm.GemmConfig is GemmConfig and jmm.GemmTiles is GemmTiles


# bench_moe.py's shapes (T, H, I, E, K): its decode rows (q30-t<T>, q235-t<T>) and its training rows.
Q30, Q235 = (2048, 768, 128, 8), (4096, 1536, 128, 8)
DECODE_SHAPES = {f"{name}-t{t}": (t, *dims) for name, dims in (("q30", Q30), ("q235", Q235)) for t in (8, 64, 256, 512)}
TRAINING_SHAPES = {"q30s": (2048, *Q30), "q30": (16384, *Q30), "q235": (16384, *Q235)}


@pytest.mark.parametrize("shape", [*DECODE_SHAPES, *TRAINING_SHAPES])
def test_the_heuristic_takes_the_measured_fastest_tiles(shape):
    """At every bench_moe.py size, decode and training, the CUTLASS tiles measured fastest or level
    (benchmarks/README.md): the heuristic picks them for all four row GEMMs, never SMALL_ROWS."""
    t, h, i, e, k = {**DECODE_SHAPES, **TRAINING_SHAPES}[shape]
    assert GemmConfig.for_problem(t, k, h, i, e) == GemmConfig(*(GemmTiles.COOP_128X256,) * 4)


def test_moe_ffn_rejects_a_gemm_config_of_another_type():
    args = (
        jnp.zeros((T, H)),
        jnp.zeros((T, K)),
        jnp.zeros((T, K), jnp.int32),
        jnp.zeros((E, H, 2 * I)),
        jnp.zeros((E, I, H)),
    )
    with pytest.raises(TypeError, match="gemm_config must be None or a jax_megamoe.GemmConfig"):
        jmm.moe_ffn(*args, implementation="cpu", gemm_config={"fwd_down": 0})


def test_cpu_calls_have_no_workspace_result_and_no_tiles():
    x = jnp.ones((T, H), jnp.float32)
    text = (
        jax.jit(
            lambda x: jmm.moe_ffn(
                x,
                jnp.ones((T, K)),
                jnp.zeros((T, K), jnp.int32),
                jnp.ones((E, H, 2 * I)),
                jnp.ones((E, I, H)),
                implementation="cpu",
            )
        )
        .lower(x)
        .as_text()
    )
    found = calls(text)
    assert sorted(found) == ["jmm_cpu_moe_down", "jmm_cpu_moe_gate_up", "jmm_cpu_moe_layout"]
    assert not any("ui8" in line.rsplit("->", 1)[1] for line in found.values())
    assert not any(tile_attributes(line) for line in found.values())


def test_cuda_backward_writes_dz_over_gate_up(cuda_lowering):
    """The CUDA backward returns dz (gate_up's gradient) aliased to its gate_up operand, so it needs no
    rows x 2I scratch of its own: the alias is in the lowered call, on a result of gate_up's type, and it is
    the one _targets.py declares."""
    line = calls(lowered_cuda_step(jnp.bfloat16))["jmm_cuda_moe_backward"]
    types = re.search(r"\} : \((.*)\) -> \((.*)\)$", line)
    operand_types, result_types = types.group(1).split(", "), types.group(2).split(", ")
    alias = re.search(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", line)
    assert alias, line
    result, operand = int(alias.group(1)), int(alias.group(2))
    assert dict(_targets.MOE_BACKWARD["cuda"].aliases) == {operand: result}
    assert operand_types[operand] == result_types[result] == f"tensor<{T * K}x{2 * I}xbf16>"
    assert result == len(result_types) - 2  # dz, then the workspace
