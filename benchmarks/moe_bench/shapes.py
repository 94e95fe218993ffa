"""The problems every implementation runs: the configs' sizes (T, H, I, E, K), the routings and their prior, the
variants, and which configs are decode sizes."""

from __future__ import annotations

DECODE_TOKENS = (8, 64, 256, 512)  # one decode step's batch
CONFIGS = {  # name: (T, H, I, E, K), in ascending memory order
    "tiny": (64, 128, 64, 8, 2),  # the CPU smoke test's size
    **{f"q30-t{t}": (t, 2048, 768, 128, 8) for t in DECODE_TOKENS},
    "q30s": (2048, 2048, 768, 128, 8),
    "q30": (16384, 2048, 768, 128, 8),
    **{f"q235-t{t}": (t, 4096, 1536, 128, 8) for t in DECODE_TOKENS},
    "q235": (16384, 4096, 1536, 128, 8),
}
ROUTINGS = ("uniform", "zipf")
VARIANTS = ("plain", "router", "remat")


def is_decode_config(cname):
    return "-t" in cname


def log_prior(e, routing, xp):
    """Log-probabilities of the experts before noise: flat, or Zipf-like (`xp`: numpy, jax.numpy or torch)."""
    if routing == "uniform":
        return xp.zeros(e)
    return -1.2 * xp.log1p(xp.arange(e, dtype=xp.float32))
