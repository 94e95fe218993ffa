"""jax_megamoe: fast, trainable Mixture-of-Experts for JAX (XLA FFI kernels, expert parallelism, Flax)."""

from jax_megamoe import losses
from jax_megamoe.ops.gemm_config import GemmConfig, GemmTiles
from jax_megamoe.ops.moe import moe_ffn
from jax_megamoe.ops.routing import load_balancing_loss, route, router_z_loss
from jax_megamoe.parallel import EPStats, NvlinkTransport, NvlinkWorkspace, Transport, moe_ffn_ep

__all__ = [
    "route",
    "moe_ffn",
    "moe_ffn_ep",
    "EPStats",
    "GemmConfig",
    "GemmTiles",
    "NvlinkTransport",
    "NvlinkWorkspace",
    "Transport",
    "load_balancing_loss",
    "router_z_loss",
    "losses",
]
__version__ = "0.1.0"
