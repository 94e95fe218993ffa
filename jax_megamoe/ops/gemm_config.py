"""Tile configurations of the CUDA row-grouped GEMMs, chosen by a heuristic from the problem's shape.

A `GemmConfig` is part of the compiled program: it travels to the CUDA handlers as integer FFI attributes
(`fwd_gate_up_tiles`, ...), so a call captured into a CUDA graph and its replays agree. `moe_ffn` picks one
with `GemmConfig.for_problem`; benchmarks pass their own to compare tiles in one build.
"""

from __future__ import annotations

import dataclasses
import enum


class GemmTiles(enum.IntEnum):
    """The kernels of the row-grouped bf16 GEMMs; values are `cuda::GemmTiles`'s."""

    COOP_128X256 = 0  # CUTLASS sm90, cooperative schedule, 128 x 256 x 64 tiles, no cluster
    SMALL_ROWS = 1  # a 128-column slice of one expert's weights per block, its rows 64 at a time (mma.sync)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """The tiles of each row-grouped GEMM of one forward and backward (the weight-gradient GEMMs have one
    configuration). `fwd_gate_up`: x @ W_gate_up; `fwd_down`: h @ W_down; `bwd_down`: dy @ W_down^T;
    `bwd_gate_up`: dz @ W_gate_up^T."""

    fwd_gate_up: GemmTiles = GemmTiles.COOP_128X256
    fwd_down: GemmTiles = GemmTiles.COOP_128X256
    bwd_down: GemmTiles = GemmTiles.COOP_128X256
    bwd_gate_up: GemmTiles = GemmTiles.COOP_128X256

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, GemmTiles):
                raise TypeError(f"GemmConfig.{field.name} must be a GemmTiles, got {value!r}")

    @classmethod
    def for_problem(cls, tokens: int, top_k: int, hidden: int, intermediate: int, experts: int) -> GemmConfig:
        """The tiles for a problem of these sizes: cooperative 128 x 256 tiles without a cluster for every GEMM.

        They measured fastest, or within run-to-run spread of the fastest, at every size of bench_moe.py
        (benchmarks/README.md). At the training sizes (q30s, q30, q235): a cluster's padding of row tiles costs more
        than its weight multicast saves, and 64-row pingpong tiles won only within the spread at 16 rows per
        expert and lost under skewed routing. At the decode sizes (8 to 512 tokens, 0.5 to 32 rows per expert)
        both kernels read the touched weights near the bandwidth, and `SMALL_ROWS` came out level at 8 and 64
        tokens and slower at 256 and 512, so it has no rule. A kernel earns a rule here once it wins."""
        del tokens, top_k, hidden, intermediate, experts  # one configuration serves every measured shape
        return cls()
