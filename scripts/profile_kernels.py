"""Per-kernel device time and DRAM traffic of one `moe_ffn` forward+backward, read by Nsight Compute.

    ncu --profile-from-start off --clock-control none --csv \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
        python scripts/profile_kernels.py run q30 uniform > kernels.csv
    python scripts/profile_kernels.py summarize kernels.csv

`run` compiles the bf16 forward+backward at a bench_moe.py shape (q30s, q30 or q235) and routing
(uniform or zipf, as bench_moe.py draws them), runs it twice, then once between cudaProfilerStart and
cudaProfilerStop (through torch), so that only that call is profiled. `summarize` prints each kernel in
launch order with its time (us) and DRAM bytes read and written (MB), and the totals.
"""

from __future__ import annotations

import csv
import math
import sys

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
    elif len(sys.argv) == 3 and sys.argv[1] == "summarize":
        summarize(sys.argv[2])
    else:
        sys.exit(__doc__)
