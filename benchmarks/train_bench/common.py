"""What every stack shares: the model config, the tokens, the optimizer's hyperparameters, the timing loop, the
temporary bytes of a compiled step, and a failure's status line."""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import time

LEARNING_RATE, BETAS, WEIGHT_DECAY = 1e-4, (0.9, 0.95), 0.1  # the same AdamW for every stack


def model_config(preset: str, layers: int):
    from jax_megamoe.models.qwen3_moe_config import qwen3_30b_a3b, tiny

    base = tiny() if preset == "tiny" else qwen3_30b_a3b()
    return dataclasses.replace(base, num_hidden_layers=layers)


def make_tokens(vocab: int, batch: int, seq: int, seed: int):
    """`[batch, seq + 1]` int32 ids from `seed`: inputs are `[:, :-1]`, labels `[:, 1:]`; and their sha1, so
    the rows can show that every stack trained on the same tokens."""
    import numpy as np

    tokens = np.random.default_rng(seed).integers(0, vocab, (batch, seq + 1), dtype=np.int32)
    return tokens, hashlib.sha1(tokens.tobytes()).hexdigest()[:16]


def error_status(err: BaseException) -> str:
    text = str(err) or repr(err)
    oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
    return ("OOM: " if oom else "error: ") + f"{type(err).__name__}: " + text.strip().splitlines()[0][:300]


def median_ms(times_s):
    return 1e3 * statistics.median(times_s) if times_s else None


def time_steps(run, sync, warmup: int, steps: int, keep_first: bool = False):
    """Runs `run()` `warmup + steps` times, each synchronised; returns `(first result or None, timed
    seconds)`. The first result is kept only when asked: a result holding gradients would stay allocated."""
    first, times = None, []
    for i in range(warmup + steps):
        began = time.perf_counter()
        out = run()
        sync(out)
        if i >= warmup:
            times.append(time.perf_counter() - began)
        if i == 0 and keep_first:
            first = out
        del out
    return first, times


def compiled_temp_bytes(compiled):
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every platform reports it
        return None
