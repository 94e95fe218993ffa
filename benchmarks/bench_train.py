"""End-to-end training-step benchmark: our Qwen3-MoE training step against the peers, in one run.

Every stack trains the same config on the same tokens (random ids from one seed, `--batch` x `--seq` inputs
and their next-token labels), one subprocess each, so each one's peak memory is its own:

  ours             jax_megamoe's `Qwen3MoeForCausalLM` (bf16 compute, `--param-dtype` parameters, default
                   float32; implementation="auto"; cuDNN attention on GPUs), optax AdamW in one jitted step;
                   loss = LM cross-entropy by optax on the full float32 logits + the router's aux loss.
  ours_lce         the same with the LM head and its cross-entropy as `jax_megamoe.losses.linear_cross_entropy`
                   on `model.hidden_states` and `model.lm_head_kernel()` (no [N, V] logits).
  ours_lce_remat   ours_lce with `remat=True` and a policy saving moe_ffn's named residuals ("moe_layout",
                   "moe_gate_up"): the training example's `--remat --remat-save-moe`.
  ours_remat       the same with the optax head.
  ours_unrolled    ours with the decoder layers as a Python loop (`scan_layers=False`) instead of one
                   scan over stacked layers (`jax_megamoe.models.layer_scan`): what scanning costs or saves at
                   this depth.
  ours_fp8         ours with the experts' GEMMs in FP8 (`recipe="fp8_blockwise"`, docs/fp8.md): the training
                   job's `--recipe fp8_blockwise`.
  tokamax          the same JAX model and step (optax head, bf16 parameters) with the experts as a pure-JAX
                   sort + `tokamax.ragged_dot` (its Mosaic GPU kernel, pinned so that no silent fallback to XLA
                   is timed) passed as `implementation=`. GPU only. Its packages may sit in `--peer-site`
                   (appended to sys.path in that child only, so the environment's own packages win).
  ragged_dot       the same with `jax.lax.ragged_dot` instead (not run by default: XLA's lowering expands the
                   groups densely on GPUs; on a CPU it checks the peer's code path).
  torch            Hugging Face transformers' `Qwen3MoeForCausalLM` (bf16 parameters, sdpa attention, its
                   grouped_mm experts where the installed transformers offers them), torch.optim.AdamW
                   (fused), eager; loss = cross-entropy of the float32 logits + router_aux_loss_coef * aux loss.

Reported per stack: the median step time over `--steps` steps after `--warmup` steps (each step synchronised
with the device), tokens/s, MFU (model FLOPs: 6 per active matmul parameter per token plus causal attention,
over a bf16 matmul rate measured in the same run: 8192^3, median of several, torch on GPUs, JAX elsewhere),
peak device memory (None where the platform keeps no statistics, e.g. CPUs), the first step's LM loss
(near ln(vocab) at initialisation). For `--breakdown` stacks (ours, ours_lce by default) in the same process:
experts = step - the same step with the experts replaced by a zero function (moe_ffn and its weight casts;
the router stays); optimizer = step - the step without the optimizer update (loss and gradients only);
LM head + loss = forward+backward of the head and its cross-entropy alone, on [N, H] bf16 hidden states
(random: the time does not depend on their values) and the head's parameter; rest = what remains
(attention, norms, router, embedding). Beside them, `moe_ffn_alone_ms`: one moe_ffn per sparse layer at the
step's size, forward+backward with the weight casts, in one jitted call, and `experts_over_alone`, the experts
term over it (what the MoE layers cost inside the step against alone).
With `--profile DIR`, each JAX stack then runs `PROFILE_STEPS` more steps under the JAX profiler (the trace in
DIR/<stack>/, for Perfetto) and its row gets `profile`: the device's events per step by time (the top
`PROFILE_TOP`), and the last step's streams: each stream's busy time and the busiest one's idle gaps (where the
step waits, and for what).

Usage: python benchmarks/bench_train.py [--preset qwen3-30b-a3b-4layer|tiny] [--layers L] [--batch B]
           [--seq S] [--steps N] [--warmup W] [--param-dtype float32|bfloat16] [--stacks ours,ours_lce,...]
           [--breakdown ours,ours_lce] [--profile DIR] [--peer-site DIR] [--json F] [--png F]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time

STACKS = (
    "ours",
    "ours_lce",
    "ours_remat",
    "ours_lce_remat",
    "ours_unrolled",
    "ours_fp8",
    "tokamax",
    "ragged_dot",
    "torch",
)
# The peers run right after our first row, so that a run cut short still holds all three stacks.
DEFAULT_STACKS = ("ours", "tokamax", "torch", "ours_lce", "ours_lce_remat", "ours_unrolled", "ours_fp8")
DEFAULT_BREAKDOWN = ("ours", "ours_lce")
# Per preset: (layers, batch, seq, steps, warmup); the flags override each.
PRESETS = {"qwen3-30b-a3b-4layer": (4, 4, 4096, 10, 3), "tiny": (2, 2, 32, 3, 1)}
PARAM_DTYPES = ("float32", "bfloat16")
LEARNING_RATE, BETAS, WEIGHT_DECAY = 1e-4, (0.9, 0.95), 0.1  # the same AdamW for every stack
ROW_TAG = "JMM_TRAIN_ROW "


def stack_label(name: str, param_dtype: str) -> str:
    pd = "bf16" if name in ("tokamax", "ragged_dot", "torch") else {"float32": "f32", "bfloat16": "bf16"}[param_dtype]
    labels = {
        "ours": "ours, optax CE",
        "ours_lce": "ours, linear_cross_entropy",
        "ours_remat": "ours remat+save-moe, optax CE",
        "ours_lce_remat": "ours remat+save-moe, linear_cross_entropy",
        "ours_unrolled": "ours unrolled layers, optax CE",
        "ours_fp8": "ours FP8 blockwise experts, optax CE",
        "tokamax": "JAX + sort + tokamax ragged_dot",
        "ragged_dot": "JAX + sort + lax.ragged_dot",
        "torch": "transformers grouped_mm + fused AdamW",
    }
    return f"{labels[name]} ({pd} params)"


# -------------------------------------------------------------------------------------- shared plumbing


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


def active_params_per_token(config) -> int:
    """Matmul parameters one token passes through: attention projections, router, its top-k experts (or the
    dense MLP) per layer, and the LM head (embedding lookups and norms are no matmuls)."""
    hidden, head_dim = config.hidden_size, config.head_dim
    attention = hidden * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    total = config.vocab_size * hidden
    for layer in range(config.num_hidden_layers):
        if config.is_moe_layer(layer):
            total += (
                hidden * config.num_experts + config.num_experts_per_tok * 3 * hidden * config.moe_intermediate_size
            )
        else:
            total += 3 * hidden * config.intermediate_size
        total += attention
    return total


def train_flops_per_step(config, batch: int, seq: int) -> float:
    """`(6 * N_active + 6 * L * S * heads * head_dim) * tokens`: 2 (multiply-add) x 3 (forward and two
    backward matmuls) per active parameter; attention's QK^T and PV (4 S heads head_dim per token and
    layer forward) halved by the causal mask, times 3. The examples' training metrics count the same."""
    attention = 6 * config.num_hidden_layers * seq * config.num_attention_heads * config.head_dim
    return float((6 * active_params_per_token(config) + attention) * batch * seq)


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


# ------------------------------------------------------------------------------------------- JAX stacks


def zero_experts(x, weights, experts, w_gate_up, w_down):
    """The experts replaced by nothing (moe_ffn's signature): the breakdown's step without them."""
    import jax.numpy as jnp

    return jnp.zeros_like(x)


def sorted_ragged_ffn(ragged_dot):
    """A pure-JAX expert path with moe_ffn's positional signature: sort the (token, k) pairs by expert, two
    grouped matmuls `ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G])`, weighted scatter-add back."""
    import jax
    import jax.numpy as jnp

    def ffn(x, weights, experts, w_gate_up, w_down):
        top_k, num_experts = experts.shape[1], w_gate_up.shape[0]
        flat = experts.reshape(-1)
        valid = (flat >= 0) & (flat < num_experts)
        order = jnp.argsort(jnp.where(valid, flat, num_experts), stable=True)  # dropped pairs sort last
        token_of_row = order // top_k
        sizes = jnp.bincount(jnp.where(valid, flat, 0), weights=valid.astype(jnp.int32), length=num_experts).astype(
            jnp.int32
        )
        gate, up = jnp.split(ragged_dot(x[token_of_row], w_gate_up, sizes), 2, axis=-1)
        rows = ragged_dot(jax.nn.silu(gate) * up, w_down, sizes)
        row_weights = jnp.where(valid, weights.reshape(-1), 0)[order].astype(jnp.float32)
        y = jnp.zeros(x.shape, jnp.float32).at[token_of_row].add(rows.astype(jnp.float32) * row_weights[:, None])
        return y.astype(x.dtype)

    return ffn


def stub_xprof() -> bool:
    """tokamax imports `xprof.cli.tools.get_kernel_stats_tool` for its profiler-based timing, which this
    benchmark does not use; where no xprof is installed, stub modules satisfy that import (this process only).
    Returns whether the stub was installed."""
    if importlib.util.find_spec("xprof") is not None:
        return False
    import types

    modules = {name: types.ModuleType(name) for name in ("xprof", "xprof.cli", "xprof.cli.tools")}
    for module in modules.values():
        module.__path__ = []  # packages, so that submodule imports resolve to the stubs
    modules["xprof"].cli = modules["xprof.cli"]
    modules["xprof.cli"].tools = modules["xprof.cli.tools"]

    def get_kernel_stats_tool(*args, **kwargs):
        raise RuntimeError("xprof is a stub in bench_train.py's tokamax child: no profiler-based timing")

    modules["xprof.cli.tools"].get_kernel_stats_tool = get_kernel_stats_tool
    sys.modules.update(modules)
    return True


def expert_path(name: str, args, row: dict):
    """`(implementation for Qwen3MoeForCausalLM, param dtype)` of a JAX stack; records what it chose in `row`.
    Raises `Skip` when the stack cannot run here."""
    import jax
    import jax.numpy as jnp

    if name.startswith("ours"):
        from jax_megamoe.ops.moe import resolve_implementation

        row["implementation"] = f"auto ({resolve_implementation('auto')})"
        return "auto", jnp.dtype(args.param_dtype)
    if name == "ragged_dot":
        row["implementation"] = "sort + jax.lax.ragged_dot"
        return sorted_ragged_ffn(lambda a, b, s: jax.lax.ragged_dot(a, b, s)), jnp.bfloat16
    # tokamax
    if jax.default_backend() != "gpu":
        raise Skip(
            f"skipped: tokamax's ragged_dot kernel (Mosaic GPU) needs a GPU; platform is {jax.default_backend()}"
        )
    if args.peer_site:
        sys.path.append(args.peer_site)
    sys.argv = sys.argv[:1]  # tokamax's absl flags parse sys.argv and refuse this child's own arguments
    row["xprof_stub"] = stub_xprof()
    try:
        import tokamax
    except Exception as err:  # any import failure means the peer is unavailable
        raise Skip(f"skipped: tokamax not importable ({err!r})") from err
    row["versions"]["tokamax"] = getattr(tokamax, "__version__", "?")
    row["implementation"] = "sort + tokamax.ragged_dot(implementation='mosaic')"
    return sorted_ragged_ffn(lambda a, b, s: tokamax.ragged_dot(a, b, s, implementation="mosaic")), jnp.bfloat16


class Skip(Exception):
    """A stack that cannot run here; its message is the row's status."""


PROFILE_STEPS = 3
PROFILE_TOP = 30  # events kept per step in a row's profile


def stream_summary(events: list[dict]) -> dict:
    """One step's events (`profile_ep.last_step_timeline`'s, of one device): each stream's busy milliseconds, and
    the busiest stream's idle time inside the step with its longest gaps (the event before and after each)."""
    busy: dict[str, float] = {}
    for event in events:
        busy[event["stream"]] = busy.get(event["stream"], 0.0) + event["dur_us"] / 1e3
    if not events:
        return dict(streams={})
    main = max(busy, key=busy.get)
    gaps, end, previous = [], None, None
    for event in (e for e in events if e["stream"] == main):
        if end is not None and event["start_us"] > end:
            gaps.append(dict(us=round(event["start_us"] - end, 1), after=previous, before=event["name"]))
        end = max(end or 0.0, event["start_us"] + event["dur_us"])
        previous = event["name"]
    span = max(e["start_us"] + e["dur_us"] for e in events) - min(e["start_us"] for e in events)
    return dict(
        streams={name: round(ms, 3) for name, ms in sorted(busy.items(), key=lambda item: -item[1])},
        step_span_ms=round(span / 1e3, 3),
        busiest=main,
        idle_ms=round(sum(g["us"] for g in gaps) / 1e3, 3),
        longest_gaps=sorted(gaps, key=lambda g: -g["us"])[:10],
    )


def profile_steps(run_step, sync, out_dir: str, on_gpu: bool) -> dict:
    """`PROFILE_STEPS` steps under the JAX profiler (trace in `out_dir`): the device's events per step, and the last
    step's streams (`stream_summary`). On a CPU the host's XLA threads stand in for the device."""
    from pathlib import Path

    import jax
    import profile_ep  # benchmarks/, beside this script

    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        for _ in range(PROFILE_STEPS):
            sync(run_step())
    trace = profile_ep.latest_trace(Path(out_dir))
    process = profile_ep.DEVICE_PROCESS if on_gpu else r"^/host:CPU"
    per_step = profile_ep.per_step(profile_ep.kernel_times(trace, process), PROFILE_STEPS)
    timeline = profile_ep.last_step_timeline(trace, process, PROFILE_STEPS)
    return {
        name: dict(
            events_ms=summary["total_ms"],
            top=[dict(e, ms=round(e["ms"], 4)) for e in summary["events"][:PROFILE_TOP]],
            last_step=stream_summary(timeline.get(name, [])),
        )
        for name, summary in per_step.items()
    }


def compiled_temp_bytes(compiled):
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every platform reports it
        return None


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


def jax_breakdown(args, row, config, graphdef, create, loss_fn, train_step, state, inputs, labels, head, sync) -> dict:
    """Times the variants of `row`'s step that its breakdown subtracts (see the module docstring)."""
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


# ----------------------------------------------------------------------------------------- torch stack


def run_torch(args) -> dict:
    try:
        import torch
        import torch.nn.functional as F
        import transformers
        from transformers import Qwen3MoeForCausalLM as HfQwen3Moe
    except Exception as err:  # noqa: BLE001 - a missing peer is a row, not a crash
        return dict(status=f"skipped: torch/transformers not importable ({err!r})")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = dev.type == "cuda"
    row = dict(
        device=torch.cuda.get_device_name(dev) if on_gpu else "cpu",
        platform=dev.type,
        head="torch CE",
        param_dtype="bfloat16",
        remat=False,
        attention_impl="sdpa",
        versions=dict(torch=torch.__version__, transformers=transformers.__version__),
    )
    config = model_config(args.preset, args.layers)

    def sync(_):
        if on_gpu:
            torch.cuda.synchronize()

    try:
        values = {k: v for k, v in config.to_dict().items() if k not in ("architectures", "model_type")}
        hf_config = transformers.Qwen3MoeConfig(**values)
        hf_config.output_router_logits = True
        torch.manual_seed(args.seed)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        kwargs = dict(dtype=torch.bfloat16, attn_implementation="sdpa")
        with torch.device(dev):
            try:  # transformers' own grouped_mm experts where this version offers them
                model = HfQwen3Moe._from_config(hf_config, experts_implementation="grouped_mm", **kwargs)
            except (TypeError, ValueError, ImportError) as err:
                row["experts_fallback"] = repr(err)[:200]
                model = HfQwen3Moe._from_config(hf_config, **kwargs)
        model.train()
        row["experts_implementation"] = getattr(model.config, "_experts_implementation", None) or "eager"
        row["attention_impl"] = model.config._attn_implementation
        row["parameters"] = int(sum(p.numel() for p in model.parameters()))
        try:
            opt = torch.optim.AdamW(
                model.parameters(), lr=LEARNING_RATE, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=True
            )
            row["optimizer"] = "AdamW(fused=True)"
        except (RuntimeError, ValueError) as err:  # fused needs a supported device and dtype
            opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=BETAS, weight_decay=WEIGHT_DECAY)
            row["optimizer"] = f"AdamW (fused unavailable: {str(err)[:100]})"
        tokens, row["tokens_sha1"] = make_tokens(config.vocab_size, args.batch, args.seq, args.seed)
        tokens = torch.from_numpy(tokens).long().to(dev)
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

        def run_step():
            opt.zero_grad(set_to_none=True)
            out = model(input_ids=inputs, use_cache=False, output_router_logits=True)
            lm = F.cross_entropy(out.logits.float().reshape(-1, config.vocab_size), labels.reshape(-1))
            loss = lm + config.router_aux_loss_coef * out.aux_loss
            loss.backward()
            opt.step()
            return loss.detach(), lm.detach()

        (loss, lm), times = time_steps(run_step, sync, args.warmup, args.steps, keep_first=True)
        row.update(
            first_loss=float(loss),
            first_lm_loss=float(lm),
            step_s=times,
            median_step_ms=median_ms(times),
            peak_memory_bytes=int(torch.cuda.max_memory_allocated(dev)) if on_gpu else None,
        )
        row["status"] = "ok"
    except Exception as err:  # noqa: BLE001
        row["status"] = error_status(err)
    return row


# ------------------------------------------------------------------------------------------ matmul rate


def run_matmul(args) -> dict:
    """The bf16 matmul rate of this device (torch on a GPU, JAX elsewhere), the MFU denominator."""

    def median_call_ms(fn, sync, samples=10, inner=10):
        for _ in range(3):
            sync(fn())
        times = []
        for _ in range(samples):
            began = time.perf_counter()
            for _ in range(inner):
                out = fn()
            sync(out)
            times.append((time.perf_counter() - began) * 1e3 / inner)
        return statistics.median(times)

    try:
        import torch

        use_torch = torch.cuda.is_available()
    except ImportError:
        use_torch = False
    if use_torch:
        size = args.matmul_size or 8192
        a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        ms = median_call_ms(lambda: a @ b, lambda _: torch.cuda.synchronize())
        library, device = "torch", torch.cuda.get_device_name()
    else:
        import jax
        import jax.numpy as jnp

        on_gpu = jax.default_backend() == "gpu"
        size = args.matmul_size or (8192 if on_gpu else 512)  # bf16 on a CPU: 8192^3 would take minutes
        keys = jax.random.split(jax.random.PRNGKey(0))
        a = jax.random.normal(keys[0], (size, size), jnp.bfloat16)
        b = jax.random.normal(keys[1], (size, size), jnp.bfloat16)
        mm = jax.jit(jnp.dot)
        ms = median_call_ms(lambda: mm(a, b), jax.block_until_ready)
        library, device = "jax", jax.devices()[0].device_kind
    return dict(status="ok", size=size, library=library, device=device, ms=ms, tflops=2 * size**3 / ms / 1e9)


# --------------------------------------------------------------------------------------------- driver


def child(args) -> None:
    """One stack's row (or the matmul rate) as a tagged JSON line on stdout, for the driver."""
    if args.child == "matmul":
        row = run_matmul(args)
    elif args.child == "torch":
        row = run_torch(args)
    else:
        row = run_jax(args.child, args)
    print(ROW_TAG + json.dumps(row), flush=True)


def child_command(args, name: str) -> list[str]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        name,
        "--preset",
        args.preset,
        "--layers",
        str(args.layers),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--param-dtype",
        args.param_dtype,
        "--seed",
        str(args.seed),
        "--breakdown",
        ",".join(args.breakdown) or "none",
    ]
    if args.peer_site:
        cmd += ["--peer-site", args.peer_site]
    if args.profile:
        cmd += ["--profile", os.path.abspath(args.profile)]
    if args.matmul_size:
        cmd += ["--matmul-size", str(args.matmul_size)]
    return cmd


def child_env() -> dict:
    env = dict(os.environ)
    # The breakdown's variants run beside the step's state; JAX's default pool (75% of the GPU) can be short.
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def run_child(args, name: str, timeout: float) -> dict:
    """`child` in a subprocess of its own: its row, or a row saying how it ended."""
    try:
        proc = subprocess.run(
            child_command(args, name), capture_output=True, text=True, env=child_env(), timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return dict(status=f"timed out after {timeout:.0f} s")
    found = [line for line in proc.stdout.splitlines() if line.startswith(ROW_TAG)]
    if found:
        return json.loads(found[-1][len(ROW_TAG) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return dict(status=f"crashed rc={proc.returncode}: " + " | ".join(tail)[:400])


def with_rates(row: dict, tokens_per_step: int, flops_per_step: float, matmul_tflops: float | None) -> dict:
    if row.get("status") == "ok" and row.get("median_step_ms"):
        seconds = row["median_step_ms"] / 1e3
        row["tokens_per_s"] = tokens_per_step / seconds
        row["model_tflops"] = flops_per_step / seconds / 1e12
        row["mfu"] = row["model_tflops"] / matmul_tflops if matmul_tflops else None
    if row.get("peak_memory_bytes") is not None:
        row["peak_memory_gib"] = row["peak_memory_bytes"] / 2**30
    return row


def fmt(value, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def table(result: dict) -> str:
    mm = result["matmul"]
    rate = f"{mm['tflops']:.3g} TF/s" if mm.get("status") == "ok" else mm.get("status", "?")
    config = result["config"]
    lines = [
        (
            f"{result['preset']}: {config['num_hidden_layers']} layers, vocab {config['vocab_size']}, "
            f"batch {result['batch']} x seq {result['seq']} ({result['tokens_per_step']} tokens/step), "
            f"{result['flops_per_step'] / 1e12:.3g} model TFLOP/step; median of {result['steps']} steps after "
            f"{result['warmup']} warm-up"
        ),
        f"bf16 matmul ({mm.get('size')}^3, {mm.get('library')}) in this run: {rate}",
    ]
    w = max(len(r["label"]) for r in result["stacks"]) + 2
    lines.append(
        f"{'stack':<{w}}{'step ms':>9}{'tok/s':>10}{'MFU':>7}{'peak GiB':>10}{'loss0':>8}"
        f"{'experts':>9}{'optim':>8}{'head+CE':>9}{'rest':>8}  status"
    )
    for r in result["stacks"]:
        b = r.get("breakdown", {})
        head = f"{r['label']:<{w}}"
        if r.get("status") != "ok":
            lines.append(f"{head}{'':>78}  {r.get('status')}")
            continue
        lines.append(
            head
            + fmt(r["median_step_ms"], ".1f", 9)
            + fmt(r.get("tokens_per_s"), ",.0f", 10)
            + (fmt(100 * r["mfu"], ".1f", 6) + "%" if r.get("mfu") is not None else fmt(None, "", 7))
            + fmt(r.get("peak_memory_gib"), ".2f", 10)
            + fmt(r.get("first_lm_loss"), ".3f", 8)
            + fmt(b.get("experts_ms"), ".1f", 9)
            + fmt(b.get("optimizer_ms"), ".1f", 8)
            + fmt(b.get("lm_head_loss_ms"), ".1f", 9)
            + fmt(b.get("rest_ms"), ".1f", 8)
            + "  ok"
        )
    lines.append(
        "breakdown (ms): experts = step - step with zero experts; optim = step - step without the update; "
        "head+CE = the LM head and its loss alone (fwd+bwd); rest = the remainder"
    )
    for r in result["stacks"]:
        b = r.get("breakdown") or {}
        if r.get("status") == "ok" and b.get("moe_ffn_alone_ms"):
            lines.append(
                f"{r['label']}: experts {b['experts_ms']:.1f} ms in the step = {b['experts_over_alone']:.2f}x "
                f"the same moe_ffn calls alone ({b['moe_ffn_alone_ms']:.1f} ms, forward+backward with the casts)"
            )
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no chart")
        return
    ok = [r for r in result["stacks"] if r.get("status") == "ok"]
    if not ok:
        return
    fig, (ax_t, ax_m) = plt.subplots(
        1, 2, figsize=(15, 0.6 * len(ok) + 2.6), sharey=True, gridspec_kw=dict(width_ratios=(3, 1))
    )
    ys = range(len(ok))
    parts = (
        ("experts_ms", "experts", "tab:red"),
        ("optimizer_ms", "optimizer", "tab:orange"),
        ("lm_head_loss_ms", "LM head + loss", "tab:purple"),
        ("rest_ms", "rest", "tab:gray"),
    )
    labelled = set()
    for y, r in zip(ys, ok, strict=True):
        # The whole step, then the breakdown's parts over it (each a difference of medians: one that noise
        # makes negative is drawn as nothing, and the parts then fall short of the step).
        ax_t.barh(y, r["median_step_ms"], color="tab:blue", alpha=0.35 if "breakdown" in r else 1.0)
        left = 0.0
        for key, name, color in parts if "breakdown" in r else ():
            value = max(r["breakdown"][key], 0.0)
            ax_t.barh(y, value, left=left, height=0.5, color=color, label=None if name in labelled else name)
            labelled.add(name)
            left += value
        note = f" {r['median_step_ms']:.1f} ms, {r['tokens_per_s'] / 1e3:,.1f}k tok/s"
        if r.get("mfu") is not None:
            note += f", MFU {100 * r['mfu']:.0f}%"
        ax_t.text(max(r["median_step_ms"], left), y, note, va="center", fontsize=8)
        ax_m.barh(y, r.get("peak_memory_gib") or 0.0, color="tab:green")
    ax_t.set_yticks(list(ys), [r["label"] for r in ok])
    ax_t.invert_yaxis()
    ax_t.set_xlabel("median step time (ms)")
    ax_t.set_xlim(0, 1.6 * max(r["median_step_ms"] for r in ok))
    ax_t.set_title(
        f"training step, {result['preset']} ({result['config']['num_hidden_layers']} layers), batch "
        f"{result['batch']} x seq {result['seq']}, {result['matmul'].get('device', '')}"
    )
    if labelled:
        ax_t.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=len(parts), fontsize=8, frameon=False)
    ax_m.set_xlabel("peak device memory (GiB)")
    if all(r.get("peak_memory_gib") is None for r in ok):
        ax_m.text(
            0.5, 0.5, "no memory statistics\non this platform", ha="center", va="center", transform=ax_m.transAxes
        )
        ax_m.set_xticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_list(text: str, known, flag: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip() and s.strip() != "none"]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"error: {flag}: unknown {unknown}; known: {', '.join(known)}")
    return list(dict.fromkeys(names))


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b-4layer")
    parser.add_argument("--layers", type=int, help="decoder layers (preset default: 4, tiny: 2)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--steps", type=int, help="timed steps after the warm-up (median over them)")
    parser.add_argument("--warmup", type=int)
    parser.add_argument(
        "--param-dtype",
        choices=PARAM_DTYPES,
        default="float32",
        help="our stacks' parameter dtype (the peers keep bf16)",
    )
    parser.add_argument("--stacks", default=",".join(DEFAULT_STACKS), help=f"comma list of {', '.join(STACKS)}")
    parser.add_argument(
        "--breakdown",
        default=",".join(DEFAULT_BREAKDOWN),
        help="our stacks that also time the breakdown's variants ('none': no breakdown)",
    )
    parser.add_argument(
        "--profile", help="folder for a JAX profiler trace of each JAX stack's steps, summarised in its row"
    )
    parser.add_argument(
        "--peer-site",
        default=os.environ.get("JMM_PEER_SITE"),
        help="folder of tokamax's packages, appended to sys.path in the tokamax child only",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--matmul-size", type=int, help="the matmul rate's size (8192 on GPUs, 512 on CPUs)")
    parser.add_argument("--child-timeout", type=float, default=1500, help="seconds per stack's subprocess")
    parser.add_argument(
        "--time-budget",
        type=float,
        help="seconds for the whole run: a stack is stopped when it is spent, and the stacks not "
        "started yet are recorded as not run (the JSON, chart and table are still written)",
    )
    parser.add_argument("--json", default="bench_train.json")
    parser.add_argument("--png", default="bench_train.png", help="bar chart ('' for none)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key, default in zip(("layers", "batch", "seq", "steps", "warmup"), PRESETS[args.preset], strict=True):
        if getattr(args, key) is None:
            setattr(args, key, default)
    if min(args.layers, args.batch, args.seq, args.steps) < 1 or args.warmup < 0:
        parser.error("--layers, --batch, --seq and --steps must be positive, --warmup non-negative")
    stacks = parse_list(args.stacks, STACKS, "--stacks")
    args.breakdown = parse_list(args.breakdown, [s for s in STACKS if s.startswith("ours")], "--breakdown")
    if args.child:
        return child(args)

    config = model_config(args.preset, args.layers)
    tokens_per_step = args.batch * args.seq
    flops = train_flops_per_step(config, args.batch, args.seq)
    result = dict(
        preset=args.preset,
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        warmup=args.warmup,
        param_dtype=args.param_dtype,
        seed=args.seed,
        tokens_per_step=tokens_per_step,
        flops_per_step=flops,
        config=config.to_dict(),
        optimizer=dict(name="AdamW", lr=LEARNING_RATE, betas=BETAS, weight_decay=WEIGHT_DECAY),
        aux_loss_coef=config.router_aux_loss_coef,
        argv=sys.argv,
        stacks=[],
    )
    start = time.perf_counter()

    def time_left() -> float:
        spent = time.perf_counter() - start
        return min(args.child_timeout, args.time_budget - spent if args.time_budget else math.inf)

    result["matmul"] = run_child(args, "matmul", time_left())
    matmul_tflops = result["matmul"].get("tflops") if result["matmul"].get("status") == "ok" else None
    print(f"[matmul: {result['matmul'].get('status')}, {time.perf_counter() - start:.0f} s]", flush=True)

    def save():  # after every stack, so a run cut short keeps its rows
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    for name in stacks:
        began = time.perf_counter()
        left = time_left()
        outcome = (
            run_child(args, name, left)
            if left > 0
            else dict(status=f"not run: the time budget of {args.time_budget:g} s was spent")
        )
        row = dict(stack=name, label=stack_label(name, args.param_dtype), **outcome)
        row["wall_s"] = time.perf_counter() - began
        result["stacks"].append(with_rates(row, tokens_per_step, flops, matmul_tflops))
        print(f"[{name}: {row['status']}, {row['wall_s']:.0f} s]", flush=True)
        save()
    save()
    if args.png:
        plot(result, args.png)
    print(table(result))
    return result


if __name__ == "__main__":
    main()
