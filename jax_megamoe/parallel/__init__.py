"""Expert parallelism under `jax.shard_map`: `moe_ffn_ep` over XLA collectives or NVLink stores."""

from jax_megamoe.parallel.ep import EPStats, moe_ffn_ep
from jax_megamoe.parallel.nvlink import NvlinkWorkspace

__all__ = ["moe_ffn_ep", "EPStats", "NvlinkWorkspace"]
