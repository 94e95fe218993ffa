"""The implementations' names: the peers run by default, `ours_tiles_<spec>` (ours with an explicit
`jmm.GemmConfig`, and that config), `ours_graphs` (ours recorded into CUDA graphs, and the XLA flags that do it),
`ours_fp8`; and the rows not run, a peer at a size where it is known to be hopeless."""

from __future__ import annotations

IMPLS = ("ours", "torch_grouped_mm", "ragged_dot", "gshard", "tokamax")
TILES_PREFIX = "ours_tiles_"  # + a GemmTiles member, or gemm=member pairs joined by '+' (commas separate --impls)
GEMMS = ("fwd_gate_up", "fwd_down", "bwd_down", "bwd_gate_up")  # GemmConfig's fields
GRAPHS_IMPL = "ours_graphs"
FP8_IMPL = "ours_fp8"  # moe_ffn(..., recipe="fp8_blockwise") on the CUDA kernels, bf16 x and weights
GRAPH_XLA_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
# Peers known to be hopeless at a size are not run there (measured once): recorded as skipped.
SKIP = {
    ("gshard", "q235"): "not run: dense capacity einsum at q235 takes minutes of device time",
    ("ragged_dot", "q235"): "not run: already out of memory at q30 (dense expansion)",
}


def is_tiles_impl(impl):
    return impl.startswith(TILES_PREFIX)


def gemm_config(impl, shape):
    """The explicit `jmm.GemmConfig` of an `ours_tiles_<spec>` implementation name for a problem of `shape`
    (T, H, I, E, K), or None for any other name (moe_ffn's heuristic)."""
    if not is_tiles_impl(impl):
        return None
    import dataclasses

    from jax_megamoe import GemmConfig, GemmTiles

    spec = impl[len(TILES_PREFIX) :]
    if not spec:
        raise ValueError(f"impl {impl!r}: expected {TILES_PREFIX}<GemmTiles member or gemm=member pairs>, got nothing")

    def tiles(name):
        try:
            return GemmTiles[name.upper()]
        except KeyError:
            raise ValueError(
                f"impl {impl!r}: unknown tiles {name!r}; GemmTiles has {[t.name.lower() for t in GemmTiles]}"
            ) from None

    t, h, i, e, k = shape
    heuristic = GemmConfig.for_problem(t, k, h, i, e)
    if "=" not in spec:
        return GemmConfig(**dict.fromkeys(GEMMS, tiles(spec)))
    chosen = {}
    for part in spec.split("+"):
        gemm, _, name = part.partition("=")
        if gemm not in GEMMS or gemm in chosen:
            raise ValueError(f"impl {impl!r}: {gemm!r} is not one of {GEMMS} (each once)")
        chosen[gemm] = tiles(name)
    return dataclasses.replace(heuristic, **chosen)
