"""The CUDA MoE calls carry their temporaries as a trailing uint8 result sized by the extension (handlers.h),
which is what lets XLA capture them into CUDA graphs, and the GEMM tiles as an attribute fixed at trace time. Checked on a CPU by lowering for the CUDA platform with
a stand-in for the extension's size function; tests/test_moe_gpu.py runs the real handlers, captured."""

import re

import jax
import jax.numpy as jnp
import pytest

import jax_megamoe as jmm
from jax_megamoe import _ffi
from jax_megamoe.ops import moe as moe_ops

T, H, I, E, K = 24, 16, 8, 4, 2


class StandInExtension:
    """Answers `cuda_workspace_bytes` with a distinct size per op and records what it was asked."""
    with_cuda = True
    BYTES = {"moe_layout": 1001, "moe_gate_up": 2003, "moe_down": 2503, "moe_backward": 3005}

    def __init__(self):
        self.asked = {}

    def cuda_workspace_bytes(self, op, bfloat16, tokens, top_k, hidden, intermediate, experts):
        self.asked[op] = (bfloat16, tokens, top_k, hidden, intermediate, experts)
        return self.BYTES[op]


def lowered_cuda_step(dtype, monkeypatch):
    ext = StandInExtension()
    monkeypatch.setattr(_ffi, "extension", lambda: ext)
    monkeypatch.setattr(moe_ops, "resolve_backend", lambda backend: "cuda")

    def loss(x, weights, experts, w_gate_up, w_down):
        return jnp.sum(jmm.moe_ffn(x, weights, experts, w_gate_up, w_down, backend="cuda").astype(jnp.float32))

    args = (jnp.zeros((T, H), dtype), jnp.zeros((T, K), jnp.float32), jnp.zeros((T, K), jnp.int32),
            jnp.zeros((E, H, 2 * I), dtype), jnp.zeros((E, I, H), dtype))
    grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 3, 4)))  # the value keeps y (moe_down) in
    return grads.trace(*args).lower(lowering_platforms=("cuda",)).as_text(), ext


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_every_cuda_moe_call_has_its_workspace_result(dtype, monkeypatch):
    monkeypatch.setenv(moe_ops.GEMM_TILES_ENV, "fwd_down=pp64x256_c1")
    text, ext = lowered_cuda_step(dtype, monkeypatch)
    bf16 = dtype == jnp.bfloat16
    assert ext.asked == {"moe_layout": (False, T, K, 0, 0, E), "moe_gate_up": (bf16, T, K, H, I, E),
                         "moe_down": (bf16, T, K, H, I, E), "moe_backward": (bf16, T, K, H, I, E)}
    calls = re.findall(r"stablehlo\.custom_call @jmm_cuda_(moe_\w+)\(.*\) -> \((.*)\)", text)
    assert sorted(op for op, _ in calls) == ["moe_backward", "moe_down", "moe_gate_up", "moe_layout"]
    for op, results in calls:
        assert results.split(", ")[-1] == f"tensor<{StandInExtension.BYTES[op]}xui8>", (op, results)
    # The GEMM tiles of the trace time are attributes of the forward and backward calls (not of the layout).
    tiles = re.findall(r"@jmm_cuda_(moe_\w+)\(.*gemm_tiles = \"([^\"]*)\"", text)
    assert sorted(tiles) == [(op, "fwd_down=pp64x256_c1") for op in ("moe_backward", "moe_down", "moe_gate_up")]


def test_cpu_calls_have_no_workspace_result():
    x = jnp.ones((T, H), jnp.float32)
    text = jax.jit(lambda x: jmm.moe_ffn(x, jnp.ones((T, K)), jnp.zeros((T, K), jnp.int32),
                                         jnp.ones((E, H, 2 * I)), jnp.ones((E, I, H)), backend="cpu")
                   ).lower(x).as_text()
    results = re.findall(r"stablehlo\.custom_call @jmm_cpu_moe_(?:gate_up|down)\(.*\) -> (.*)$", text, re.M)
    assert len(results) == 2 and not any("ui8" in r for r in results)


def test_cuda_backward_writes_dz_over_gate_up(monkeypatch):
    """The CUDA backward returns dz (gate_up's gradient) aliased to its gate_up operand, so it needs no
    rows x 2I scratch of its own (handlers.h): the alias is in the lowered call, on a result of gate_up's type."""
    text, _ = lowered_cuda_step(jnp.bfloat16, monkeypatch)
    call = next(line for line in text.splitlines() if "@jmm_cuda_moe_backward" in line)
    operands = re.search(r"\} : \((.*)\) -> \((.*)\)$", call)
    operand_types, result_types = operands.group(1).split(", "), operands.group(2).split(", ")
    alias = re.search(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", call)
    assert alias, call
    result, operand = int(alias.group(1)), int(alias.group(2))
    assert operand == moe_ops._BACKWARD_GATE_UP_OPERAND
    assert operand_types[operand] == result_types[result] == f"tensor<{T * K}x{2 * I}xbf16>"
    assert result == len(result_types) - 2  # dz, then the workspace
