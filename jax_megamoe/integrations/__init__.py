"""Bridges to other libraries, each an optional extra: `jax_megamoe.integrations.tunix` (`jax_megamoe[tunix]`)."""
