"""jax_megamoe: fast, trainable Mixture-of-Experts for JAX (XLA FFI kernels, expert parallelism, Flax).

The names below load their modules on first use, so that `jax_megamoe.cli` (which a command line parses its flags
with before JAX starts) imports nothing else.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jax_megamoe import losses
    from jax_megamoe.ops.gemm_config import GemmConfig, GemmTiles
    from jax_megamoe.ops.moe import moe_ffn
    from jax_megamoe.ops.routing import load_balancing_loss, route, router_z_loss
    from jax_megamoe.parallel import EPStats, NvlinkTransport, NvlinkWorkspace, Transport, moe_ffn_ep

_MODULE_OF = {
    "route": "jax_megamoe.ops.routing",
    "moe_ffn": "jax_megamoe.ops.moe",
    "moe_ffn_ep": "jax_megamoe.parallel",
    "EPStats": "jax_megamoe.parallel",
    "GemmConfig": "jax_megamoe.ops.gemm_config",
    "GemmTiles": "jax_megamoe.ops.gemm_config",
    "NvlinkTransport": "jax_megamoe.parallel",
    "NvlinkWorkspace": "jax_megamoe.parallel",
    "Transport": "jax_megamoe.parallel",
    "load_balancing_loss": "jax_megamoe.ops.routing",
    "router_z_loss": "jax_megamoe.ops.routing",
}

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


def __getattr__(name: str) -> Any:
    if name == "losses":
        value = importlib.import_module("jax_megamoe.losses")
    elif name in _MODULE_OF:
        value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    else:
        raise AttributeError(f"module 'jax_megamoe' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
