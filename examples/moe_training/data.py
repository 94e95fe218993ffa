"""Training tokens: a byte-level corpus every machine has (the Python standard library's sources), or a
token file; deterministic batches indexed by step, so a resumed run sees exactly the same data."""

from __future__ import annotations

import os
import sysconfig

import numpy as np

BYTE_VOCAB = 256


def stdlib_corpus(max_bytes: int) -> np.ndarray:
    """The standard library's `.py` files (sorted paths, concatenated) as byte tokens, at most `max_bytes`."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "__pycache__"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(directory, name), "rb") as f:
                chunk = f.read(max_bytes - total)
            chunks.append(chunk)
            total += len(chunk)
            if total >= max_bytes:
                return np.frombuffer(b"".join(chunks), np.uint8)
    if total == 0:
        raise FileNotFoundError(f"no .py sources under the standard library directory {root}")
    return np.frombuffer(b"".join(chunks), np.uint8)


def load_token_file(path: str, bin_dtype: str) -> np.ndarray:
    """Tokens from `.npy` (any integer dtype) or a raw `.bin` of `bin_dtype` (nanoGPT style), memory-mapped."""
    if path.endswith(".npy"):
        tokens = np.load(path, mmap_mode="r")
    else:
        tokens = np.memmap(path, dtype=np.dtype(bin_dtype), mode="r")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{path}: expected a 1-D integer token array, got shape {tokens.shape} {tokens.dtype}")
    return tokens


def split(tokens: np.ndarray, eval_fraction: float, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Holds out the last `eval_fraction` of the stream (at least one sequence) for evaluation."""
    held_out = max(int(len(tokens) * eval_fraction), seq + 1)
    if len(tokens) - held_out < seq + 1:
        raise ValueError(f"{len(tokens)} tokens are too few for sequences of {seq} plus a held-out split")
    return tokens[:-held_out], tokens[-held_out:]


def batch_at(tokens: np.ndarray, step: int, batch: int, seq: int, seed: int) -> np.ndarray:
    """Batch `step`: `batch` random windows of `seq + 1` tokens (inputs and shifted targets), int32.

    Depends only on (seed, step): every process builds the same global batch, and resuming at a step
    reproduces the data of an uninterrupted run.
    """
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
    return np.stack([np.asarray(tokens[s : s + seq + 1], dtype=np.int32) for s in starts])
