"""Test configuration, set before JAX starts: 8 host CPU devices for mesh tests, and no preallocation of GPU
memory (test processes share a GPU with each other and with the training runs some tests start).

The one rule of the GPU tests: a test marked `gpu` needs one NVIDIA GPU, `gpu(count=N)` N of them, and is skipped
where fewer are visible (tests/gpus.py counts them without starting JAX). Such a test takes its JAX devices from
the `gpus` fixture."""

import os

import pytest
from gpus import visible_gpus

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def required_gpus(marker: pytest.Mark) -> int:
    count = marker.kwargs.get("count", 1)
    if marker.args or set(marker.kwargs) - {"count"} or not isinstance(count, int) or count < 1:
        raise pytest.UsageError(f"the gpu marker takes count=N (N >= 1 GPUs), got {marker}")
    return count


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return
    needed, found = required_gpus(marker), len(visible_gpus())
    if found < needed:
        pytest.skip(f"needs {needed} NVIDIA GPU{'s' if needed > 1 else ''}, {found} visible")


@pytest.fixture
def gpus():
    """The GPU devices of JAX, for tests marked `gpu`."""
    import jax  # here: nothing imports JAX before the environment above is set

    return jax.devices("gpu")


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """`(model, path)`: the tiny random transformers Qwen3-MoE of tests/hf_models.py and its `save_pretrained`
    directory, one per test module (the callers `importorskip` transformers)."""
    from hf_models import tiny_hf_model

    model = tiny_hf_model()
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path)
    return model, path
