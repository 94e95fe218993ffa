"""What a training script over the models reuses, each piece taking explicit arguments:

- the state and its step (`step.py`): `TrainState`, `abstract_state` (shapes only) and `init_state`, the
  `data` x `expert` mesh and a batch's sharding, `adamw` from explicit values, the sharded LM `cross_entropy`
  (no `[B, S, V]` logits), and `make_train_step`, the jitted optimizer step of any loss, its state donated;
- `Checkpoints` (`checkpoints.py`): orbax save and resume, refusing a checkpoint that holds another state with a
  `CheckpointMismatch` (a `ValueError` naming the array and both shapes or dtypes);
- the memory plan (`memory.py`): `plan_memory`, XLA's per-device analysis of the compiled step from shapes
  alone, and `shard_bytes`, `peak_memory_bytes`;
- FLOPs (`flops.py`): `train_flops_per_token` and `peak_flops` for MFU;
- metrics (`metrics.py`): `MetricsLog` (JSON lines), `read_metrics`, `plot_loss_curves` (on `line_plot`).

docs/post_training.md puts them together; examples/train_qwen3_moe.py and examples/rl_qwen3_moe.py are the
command-line jobs built on them.
"""

from jax_megamoe.training.checkpoints import ArraySpecs, CheckpointMismatch, Checkpoints, array_specs
from jax_megamoe.training.flops import PEAK_FLOPS, active_params_per_token, peak_flops, train_flops_per_token
from jax_megamoe.training.memory import (
    MemoryPlan,
    allocator_limit_bytes,
    memory_analysis,
    peak_memory_bytes,
    plan_memory,
    shard_bytes,
)
from jax_megamoe.training.metrics import MetricsLog, line_plot, plot_loss_curves, read_metrics
from jax_megamoe.training.step import (
    BATCH_AXES,
    LossFn,
    TrainState,
    abstract_state,
    adamw,
    batch_sharding,
    cross_entropy,
    global_batch,
    init_state,
    make_mesh,
    make_train_step,
)

__all__ = [
    "ArraySpecs",
    "BATCH_AXES",
    "PEAK_FLOPS",
    "CheckpointMismatch",
    "Checkpoints",
    "LossFn",
    "MemoryPlan",
    "MetricsLog",
    "TrainState",
    "abstract_state",
    "active_params_per_token",
    "adamw",
    "allocator_limit_bytes",
    "array_specs",
    "batch_sharding",
    "cross_entropy",
    "global_batch",
    "init_state",
    "line_plot",
    "make_mesh",
    "make_train_step",
    "memory_analysis",
    "peak_flops",
    "peak_memory_bytes",
    "plan_memory",
    "plot_loss_curves",
    "read_metrics",
    "shard_bytes",
    "train_flops_per_token",
]
