"""One JAX stack's row: our Qwen3-MoE model's training step (optax AdamW, one jitted step), compiled, timed,
and optionally profiled and broken down."""

from __future__ import annotations

import math
import os
import time

from .breakdown import jax_breakdown
from .common import (
    BETAS,
    LEARNING_RATE,
    WEIGHT_DECAY,
    compiled_temp_bytes,
    error_status,
    make_tokens,
    median_ms,
    model_config,
    time_steps,
)
from .expert_paths import Skip, expert_path
from .profiling import profile_steps


def run_jax(name: str, args) -> dict:
    import flax
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jax_megamoe
    from jax_megamoe.losses import linear_cross_entropy
    from jax_megamoe.models.qwen3_moe import Qwen3MoeForCausalLM
    from jax_megamoe.ops.moe import GATE_UP_NAME, LAYOUT_NAME

    device = jax.devices()[0]
    row = dict(
        device=device.device_kind,
        platform=device.platform,
        versions=dict(
            jax=jax.__version__, flax=flax.__version__, optax=optax.__version__, jax_megamoe=jax_megamoe.__version__
        ),
    )
    try:
        implementation, param_dtype = expert_path(name, args, row)
    except Skip as skip:
        return dict(row, status=str(skip))
    head = "linear_cross_entropy" if "_lce" in name else "optax"
    remat = name.endswith("_remat")
    scan_layers = name != "ours_unrolled"
    recipe = "fp8_blockwise" if name == "ours_fp8" else None
    on_gpu = device.platform == "gpu"
    row.update(
        head=head,
        param_dtype=jnp.dtype(param_dtype).name,
        remat=remat,
        scan_layers=scan_layers,
        recipe=recipe,
        attention_impl="cudnn" if on_gpu else "xla",
    )
    config = model_config(args.preset, args.layers)
    compute = jnp.bfloat16
    aux_coef = config.router_aux_loss_coef

    def create(impl):
        policy = jax.checkpoint_policies.save_only_these_names(LAYOUT_NAME, GATE_UP_NAME) if remat else None
        return Qwen3MoeForCausalLM(
            config,
            dtype=compute,
            param_dtype=param_dtype,
            implementation=impl,
            remat=remat,
            remat_policy=policy,
            attention_impl="cudnn" if on_gpu else None,
            scan_layers=scan_layers,
            recipe=recipe,
            rngs=nnx.Rngs(args.seed),
        )

    def loss_fn(graphdef, params, inputs, labels):
        model = nnx.merge(graphdef, params)
        if head == "optax":
            logits, aux = model(inputs)
            lm = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()
        else:
            hidden, aux = model.hidden_states(inputs)
            lm = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.lm_head_kernel(), labels.reshape(-1))
        return lm + aux_coef * aux.load_balancing_loss, lm

    tx = optax.adamw(LEARNING_RATE, b1=BETAS[0], b2=BETAS[1], weight_decay=WEIGHT_DECAY)

    def train_step(graphdef):
        """The jitted step (its state donated) of the model `graphdef` describes."""

        def step(params, opt_state, inputs, labels):
            (loss, lm), grads = jax.value_and_grad(lambda p: loss_fn(graphdef, p, inputs, labels), has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, lm

        return jax.jit(step, donate_argnums=(0, 1))

    def sync(out):
        jax.block_until_ready(out)

    try:
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: create(implementation)))
        params = jax.jit(lambda: nnx.split(create(implementation))[1])()  # born on the device, not op by op
        opt_state = jax.jit(tx.init)(params)
        row["parameters"] = int(sum(x.size for x in jax.tree.leaves(params)))
        tokens, row["tokens_sha1"] = make_tokens(config.vocab_size, args.batch, args.seq, args.seed)
        inputs, labels = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])

        began = time.perf_counter()
        step = train_step(graphdef).lower(params, opt_state, inputs, labels).compile()
        row["compile_s"] = time.perf_counter() - began
        row["step_temp_bytes"] = compiled_temp_bytes(step)
        state = [params, opt_state]

        def run_step():
            state[0], state[1], loss, lm = step(state[0], state[1], inputs, labels)
            return loss, lm

        (loss, lm), times = time_steps(run_step, sync, args.warmup, args.steps, keep_first=True)
        row.update(first_loss=float(loss), first_lm_loss=float(lm), step_s=times, median_step_ms=median_ms(times))
        stats = device.memory_stats()
        row["peak_memory_bytes"] = stats.get("peak_bytes_in_use") if stats else None  # before the variants
        if not all(math.isfinite(v) for v in (row["first_loss"], row["first_lm_loss"])):
            raise FloatingPointError(f"non-finite first loss {row['first_loss']}")
        if args.profile:
            row["profile"] = profile_steps(run_step, sync, os.path.join(args.profile, name), on_gpu)
        if name in args.breakdown:
            row["breakdown"] = jax_breakdown(
                args, row, config, graphdef, create, loss_fn, train_step, state, inputs, labels, head, sync
            )
        row["status"] = "ok"
    except Exception as err:  # noqa: BLE001 - OOM and compile failures are results here
        row["status"] = error_status(err)
    return row
