"""The nvlink transport of `moe_ffn_ep`: its workspace, plain exchange and fused expert calls."""

from jax_megamoe.parallel.nvlink.transport import NvlinkTransport
from jax_megamoe.parallel.nvlink.workspace import NvlinkWorkspace, block_bytes

__all__ = ["NvlinkTransport", "NvlinkWorkspace", "block_bytes"]
