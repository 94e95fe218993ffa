"""The variants of a JAX stack's step that its breakdown subtracts (bench_train.py's docstring defines the terms):
the step with zero experts, the step without the optimizer update, the LM head and its loss alone, and one
moe_ffn per sparse layer alone."""

from __future__ import annotations

from .common import compiled_temp_bytes, median_ms, time_steps


def zero_experts(x, weights, experts, w_gate_up, w_down):
    """The experts replaced by nothing (moe_ffn's signature): the breakdown's step without them."""
    import jax.numpy as jnp

    return jnp.zeros_like(x)


def jax_breakdown(args, row, config, graphdef, create, loss_fn, train_step, state, inputs, labels, head, sync) -> dict:
    """Times the variants of `row`'s step that its breakdown subtracts; returns the breakdown's terms."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jax_megamoe.losses import linear_cross_entropy

    out = {}
    # The step with the experts replaced by zeros: same parameters, another graph definition.
    zero_graphdef = nnx.graphdef(nnx.eval_shape(lambda: create(zero_experts)))
    zero_step = train_step(zero_graphdef).lower(state[0], state[1], inputs, labels).compile()

    def run_zero():
        state[0], state[1], loss, _ = zero_step(state[0], state[1], inputs, labels)
        return loss

    out["zero_experts_step_ms"] = median_ms(time_steps(run_zero, sync, args.warmup, args.steps)[1])

    # Loss and gradients without the optimizer update (the gradients are outputs, so nothing is dropped).
    grad_step = (
        jax.jit(lambda p, i, t: jax.value_and_grad(lambda q: loss_fn(graphdef, q, i, t), has_aux=True)(p))
        .lower(state[0], inputs, labels)
        .compile()
    )
    out["no_optimizer_step_ms"] = median_ms(
        time_steps(lambda: grad_step(state[0], inputs, labels), sync, args.warmup, args.steps)[1]
    )

    # The LM head and its loss alone: [N, H] hidden states in the compute dtype and the head's parameter.
    model = nnx.merge(graphdef, state[0])
    kernel_param = model.lm_head.kernel[...] if model.lm_head is not None else model.embed_tokens.embedding[...].T
    tokens = inputs.size
    hidden = jax.random.normal(jax.random.PRNGKey(args.seed + 1), (tokens, config.hidden_size), jnp.bfloat16)
    flat_labels = labels.reshape(-1)

    def head_loss(h, kernel, t):
        kernel = kernel.astype(h.dtype)
        if head == "optax":
            logits = jnp.dot(h, kernel)  # nnx.Linear's product: bf16 in, bf16 logits
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), t).mean()
        return linear_cross_entropy(h, kernel, t)

    head_step = (
        jax.jit(jax.value_and_grad(head_loss, argnums=(0, 1))).lower(hidden, kernel_param, flat_labels).compile()
    )
    out["lm_head_loss_temp_bytes"] = compiled_temp_bytes(head_step)
    out["lm_head_loss_ms"] = median_ms(
        time_steps(lambda: head_step(hidden, kernel_param, flat_labels), sync, args.warmup, args.steps)[1]
    )
    out["moe_ffn_alone_ms"] = moe_ffn_alone_ms(args, config, row["recipe"], sync)
    step_ms = row["median_step_ms"]
    out["experts_ms"] = step_ms - out["zero_experts_step_ms"]
    out["optimizer_ms"] = step_ms - out["no_optimizer_step_ms"]
    out["rest_ms"] = step_ms - out["experts_ms"] - out["optimizer_ms"] - out["lm_head_loss_ms"]
    out["experts_over_alone"] = out["experts_ms"] / out["moe_ffn_alone_ms"]
    return out


def moe_ffn_alone_ms(args, config, recipe, sync) -> float:
    """Forward+backward of one `moe_ffn` per sparse layer at the step's size, in one jitted call: what the
    step's experts term (moe_ffn and its weight casts) would cost alone. Each layer has its own tokens, fixed
    routing (top-k of random logits) and `--param-dtype` weights, cast to bf16 and differentiated as the model
    does; separate arrays per layer, so that no stacked buffer is timed."""
    import jax
    import jax.numpy as jnp

    from jax_megamoe import moe_ffn
    from jax_megamoe.ops.routing import route

    layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    tokens, hidden, inter = args.batch * args.seq, config.hidden_size, config.moe_intermediate_size
    experts = config.num_experts
    keys = iter(jax.random.split(jax.random.PRNGKey(args.seed + 2), 5 * layers))
    param_dtype = jnp.dtype(args.param_dtype)

    def normal(shape, dtype, scale=1.0):
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    xs = [normal((tokens, hidden), jnp.bfloat16) for _ in range(layers)]
    cotangents = [normal((tokens, hidden), jnp.bfloat16) for _ in range(layers)]
    routes = [
        route(normal((tokens, experts), jnp.float32), config.num_experts_per_tok, config.norm_topk_prob)
        for _ in range(layers)
    ]
    w_gate_up = [normal((experts, hidden, 2 * inter), param_dtype, hidden**-0.5) for _ in range(layers)]
    w_down = [normal((experts, inter, hidden), param_dtype, inter**-0.5) for _ in range(layers)]

    def loss(xs, w_gate_up, w_down):
        total = jnp.zeros((), jnp.float32)
        for x, dy, (weights, ids), wgu, wd in zip(xs, cotangents, routes, w_gate_up, w_down, strict=True):
            y = moe_ffn(x, weights, ids, wgu.astype(x.dtype), wd.astype(x.dtype), recipe=recipe)
            total += jnp.vdot(y.astype(jnp.float32), dy.astype(jnp.float32))
        return total

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(xs, w_gate_up, w_down).compile()
    return median_ms(time_steps(lambda: step(xs, w_gate_up, w_down), sync, args.warmup, args.steps)[1])
