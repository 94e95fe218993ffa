"""Expert parallelism under `jax.shard_map`: `moe_ffn_ep` over the XLA collectives or the nvlink transport."""

from jax_megamoe.parallel.ep import EPStats, moe_ffn_ep
from jax_megamoe.parallel.nvlink import NvlinkTransport, NvlinkWorkspace
from jax_megamoe.parallel.transport import Transport

__all__ = ["moe_ffn_ep", "EPStats", "NvlinkTransport", "NvlinkWorkspace", "Transport"]
