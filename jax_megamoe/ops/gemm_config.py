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


# At or below this many rows per expert (tokens * top_k / experts) the forward's row GEMMs take SMALL_ROWS.
SMALL_ROWS_PER_EXPERT = 32


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
        """The tiles for a problem of these sizes (bench_moe.py's rows, benchmarks/README.md).

        Training sizes (thousands of rows per expert): cooperative 128 x 256 tiles without a cluster measured
        fastest, or within run-to-run spread of the fastest, for every GEMM at the q30s, q30 and q235 sizes: a
        cluster's padding of row tiles costs more than its weight multicast saves, and 64-row pingpong tiles won only
        within the spread at 16 rows per expert and lost under skewed routing. Decode sizes (at most
        `SMALL_ROWS_PER_EXPERT` rows per expert): the forward's GEMMs read each touched expert's weights once
        through `SMALL_ROWS`, whose blocks carry no row padding beyond 16 rows."""
        del hidden, intermediate  # the rule depends on the rows per expert alone
        if tokens * top_k <= SMALL_ROWS_PER_EXPERT * experts:
            return cls(fwd_gate_up=GemmTiles.SMALL_ROWS, fwd_down=GemmTiles.SMALL_ROWS)
        return cls()
