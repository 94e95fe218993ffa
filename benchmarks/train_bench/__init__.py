"""The parts of the training-step benchmark, whose command line is benchmarks/bench_train.py:

- `common`: the model config, the tokens, the optimizer's hyperparameters, the timing loop, a failure's status;
- `stacks`: the stacks' names and labels;
- `rates`: model FLOPs per step, and a row's tokens/s, TFLOP/s and MFU;
- `expert_paths`: the JAX stacks' experts, ours or a peer's grouped matmul behind moe_ffn's signature;
- `jax_stack`: one JAX stack's row, our model's training step compiled and timed;
- `breakdown`: the step's variants that split its time (experts, optimizer, LM head and loss, the rest);
- `profiling`: steps under the JAX profiler, summarised per event and per stream;
- `torch_stack`: the transformers stack's row;
- `matmul`: the device's bf16 matmul rate, the MFU denominator;
- `children`: one subprocess per stack, its command line and the row it prints;
- `report`: the table printed at the end;
- `plot`: the chart.
"""
