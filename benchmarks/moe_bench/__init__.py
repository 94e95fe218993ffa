"""The parts of the MoE layer benchmark, whose command line is benchmarks/bench_moe.py:

- `shapes`: the configs' sizes, the routings and their prior, the variants, and which configs are decode sizes;
- `impls`: the implementations' names (the default peers, ours with explicit GEMM tiles, with CUDA graphs, in FP8)
  and the rows not run;
- `timing`: the timing loop every row shares;
- `jax_impls`: the JAX implementations, their variants and routing, and one JAX row;
- `torch_impls`: the torch peers (bf16 and FP8 rowwise grouped GEMMs), their variants, and one torch row;
- `device_rates`: the device's bf16 matmul rate and read bandwidth, measured in the same run;
- `rates`: a row's effective TF/s and share of the matmul rate, and at the decode sizes its floor;
- `children`: one subprocess per row, its environment and the row it prints;
- `report`: the table printed at the end;
- `plot`: the chart.
"""
