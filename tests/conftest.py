"""Test configuration: 8 host CPU devices for mesh tests (set before JAX starts)."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
