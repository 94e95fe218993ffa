"""Per-kernel device time and DRAM traffic of one `moe_ffn` forward+backward, or of one decode step of the
Qwen3-MoE model, read by Nsight Compute.

    ncu --profile-from-start off --clock-control none --csv \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
        python scripts/profile_kernels.py run q30 uniform > kernels.csv
    python scripts/profile_kernels.py summarize kernels.csv

`run` compiles the bf16 forward+backward at a bench_moe.py shape (q30s, q30 or q235) and routing
(uniform or zipf, as bench_moe.py draws them), runs it twice, then once between cudaProfilerStart and
cudaProfilerStop (through torch), so that only that call is profiled. `decode MODEL BATCH` (MODEL one of
bench_generate.py's) profiles one greedy decode step the way `generate` runs it (the model's `decode`, its
LM head and the token's choice, bf16) over a cache prefilled with 512-token prompts, 640 slots written of 768.
`summarize` prints each kernel in launch order with its time (us) and DRAM bytes read and written (MB), and
the totals.
"""

from __future__ import annotations

import csv
import functools
import math
import sys
from pathlib import Path

CONFIGS = {"q30s": (2048, 2048, 768, 128, 8), "q30": (16384, 2048, 768, 128, 8), "q235": (16384, 4096, 1536, 128, 8)}


def run(config: str, routing: str) -> None:
    import jax
    import jax.numpy as jnp
    import torch

    import jax_megamoe as jmm

    t, h, i, e, k = CONFIGS[config]
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (t, h), jnp.bfloat16)
    w_gate_up = (jax.random.normal(keys[1], (e, h, 2 * i)) / math.sqrt(h)).astype(jnp.bfloat16)
    w_down = (jax.random.normal(keys[2], (e, i, h)) / math.sqrt(i)).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[3], (t, h), jnp.bfloat16)
    log_p = jnp.zeros(e) if routing == "uniform" else -1.2 * jnp.log1p(jnp.arange(e))
    experts = jax.lax.top_k(log_p + jax.random.gumbel(keys[4], (t, e)), k)[1].astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(keys[5], (t, k)), axis=-1)

    def forward(x, weights, w_gate_up, w_down):
        return jmm.moe_ffn(x, weights, experts, w_gate_up, w_down, implementation="cuda")

    step = jax.jit(lambda *args: jax.vjp(forward, *args[:4])[1](args[4]))
    for _ in range(2):
        jax.block_until_ready(step(x, weights, w_gate_up, w_down, dy))
    torch.cuda.profiler.start()
    jax.block_until_ready(step(x, weights, w_gate_up, w_down, dy))
    torch.cuda.profiler.stop()


def decode(model_name: str, batch: int, prompt: int = 512, new: int = 256) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from bench_generate import model_config
    from flax import nnx

    from jax_megamoe.models import qwen3_moe

    config = model_config(model_name)
    model = nnx.jit(
        lambda: qwen3_moe.Qwen3MoeForCausalLM(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    )()
    ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (batch, prompt), dtype=np.int32))
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, ids):
        model = nnx.merge(graphdef, state).compute_form()
        cache = model.init_cache(batch, prompt + new)
        _, cache = model.prefill(ids, jnp.full((batch,), prompt, jnp.int32), cache)
        return cache._replace(lengths=cache.lengths + new // 2)  # the mean cache length of a generate call

    @functools.partial(jax.jit, donate_argnums=2)
    def step(state, token, cache):
        model = nnx.merge(graphdef, state).compute_form()
        hidden, cache = model.decode(token, cache)
        return jnp.argmax(model.logits(hidden[:, 0]).astype(jnp.float32), axis=-1)[:, None].astype(jnp.int32), cache

    cache = prefill(state, ids)
    token = ids[:, -1:]
    for _ in range(3):
        token, cache = jax.block_until_ready(step(state, token, cache))
    torch.cuda.profiler.start()
    token, cache = jax.block_until_ready(step(state, token, cache))
    torch.cuda.profiler.stop()


def summarize(path: str) -> None:
    with open(path) as f:
        rows = [r for r in csv.reader(f) if len(r) > 10]  # ncu's own messages have fewer columns
    head, body = rows[0], rows[1:]
    col = {c: head.index(c) for c in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}
    scale = {
        "ns": 1e-3,
        "nsecond": 1e-3,
        "us": 1.0,
        "usecond": 1.0,
        "ms": 1e3,
        "msecond": 1e3,
        "byte": 1e-6,
        "Kbyte": 1e-3,
        "Mbyte": 1.0,
        "Gbyte": 1e3,
    }  # to us and MB
    kernels: dict[str, dict] = {}  # ID -> name and metrics, in launch order
    for r in body:
        entry = kernels.setdefault(r[col["ID"]], {"name": r[col["Kernel Name"]]})
        value = float(r[col["Metric Value"]].replace(",", ""))
        entry[r[col["Metric Name"]]] = value * scale[r[col["Metric Unit"]]]
    metrics = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum")
    total = [0.0, 0.0, 0.0]
    print(f"{'time us':>10} {'read MB':>9} {'write MB':>9}  kernel")
    for kernel in kernels.values():
        values = [kernel.get(m, 0.0) for m in metrics]
        total = [a + b for a, b in zip(total, values, strict=True)]
        print(f"{values[0]:10.1f} {values[1]:9.1f} {values[2]:9.1f}  {kernel['name'][:100]}")
    print(f"{total[0]:10.1f} {total[1]:9.1f} {total[2]:9.1f}  total of {len(kernels)} kernels")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "decode":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
        decode(sys.argv[2], int(sys.argv[3]))
    elif len(sys.argv) == 3 and sys.argv[1] == "summarize":
        summarize(sys.argv[2])
    else:
        sys.exit(__doc__)
