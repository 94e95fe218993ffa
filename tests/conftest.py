"""Test configuration, set before JAX starts: 8 host CPU devices for mesh tests, and no preallocation of GPU
memory (test processes share a GPU with each other and with the training runs some tests start)."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
