"""A row's rates: its effective TF/s (the experts' FLOPs) and their share of the matmul rate, and at the decode
sizes its forward's floor, the bytes it must move over the read bandwidth."""

from __future__ import annotations

from .shapes import CONFIGS, is_decode_config


def flops_forward(t, h, i, e, k):
    return 6 * t * k * h * i


def floor_bytes(shape, experts_touched):
    """The bytes a forward must move at least: the weights of the experts the routing touches (gate/up and
    down, bf16), x read and y written."""
    t, h, i, _, _ = shape
    return experts_touched * 3 * h * i * 2 + 2 * t * h * 2


def with_rates(row, matmul_tfs, bandwidth_gbs):
    """`row` with its effective TF/s and their fraction of the matmul rate, when it has times; at the decode sizes
    also its forward's floor (`floor_bytes` over the read bandwidth) and the forward's multiple of it."""
    if row.get("status") == "ok":
        shape = CONFIGS[row["config"]]
        fl = flops_forward(*shape)
        row["fwd_tflops"] = fl / row["fwd_ms"] / 1e9
        row["fwd_bwd_tflops"] = 3 * fl / row["fwd_bwd_ms"] / 1e9
        row["fwd_pct_matmul"] = 100 * row["fwd_tflops"] / matmul_tfs
        row["fwd_bwd_pct_matmul"] = 100 * row["fwd_bwd_tflops"] / matmul_tfs
        if is_decode_config(row["config"]):
            row["floor_ms"] = floor_bytes(shape, row["experts_touched"]) / bandwidth_gbs / 1e6
            row["fwd_over_floor"] = row["fwd_ms"] / row["floor_ms"]
    return row
