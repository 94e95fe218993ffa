"""Expert parallelism under `jax.shard_map`: `moe_ffn_ep` with XLA collective transports."""

from jax_megamoe.parallel.ep import EPStats, moe_ffn_ep

__all__ = ["moe_ffn_ep", "EPStats"]
