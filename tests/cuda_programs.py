"""Builds the standalone CUDA programs of cuda/tests (checks of CUTLASS pieces not yet behind an FFI handler)
with nvcc against the installed CUTLASS headers, for the GPU tests that run them."""

import os
import pathlib
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc")


def build(name: str, out_dir: pathlib.Path) -> pathlib.Path:
    """Compiles cuda/tests/<name>.cu for sm_90a with the Release flags; returns the binary's path."""
    import cutlass_library

    cutlass_include = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    binary = out_dir / name
    built = subprocess.run(
        [
            NVCC,
            "-std=c++17",
            "--expt-relaxed-constexpr",
            "-arch=sm_90a",
            "-O3",
            "-DNDEBUG",
            f"-I{ROOT / 'cuda'}",
            f"-I{cutlass_include}",
            str(ROOT / "cuda" / "tests" / f"{name}.cu"),
            "-o",
            str(binary),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    return binary
