"""The training job's loop over jax_megamoe.training: a `data` x `expert` mesh, sharded Qwen3-MoE parameters (experts
over `expert`; with `--fsdp` everything over `data` too), a jitted AdamW step, periodic eval, orbax checkpoints,
metrics; and the memory plan (`--dry-run`: the step compiled for the mesh, nothing allocated). The model comes from
model_from_flags.py. Called by examples/train_qwen3_moe.py after JAX is configured."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jax_megamoe import cli, training
from moe_training import checkpoints, data, model_from_flags

FINAL_WINDOW = 10  # summary.json's final_loss: mean LM loss of the last steps (single steps are noisy)
GB = 1e9


def make_steps(graphdef, tx, aux_coef: float, z_coef: float, state_shardings, batch_sharding):
    """The jitted train step (donating its state; the state keeps its shardings step to step, so one
    compilation serves the whole run) and eval step."""
    mesh = batch_sharding.mesh

    def lm_loss(params, tokens):
        model = nnx.merge(graphdef, params)
        hidden, aux = model.hidden_states(tokens[:, :-1])
        return training.cross_entropy(hidden, model.lm_head_kernel(), tokens[:, 1:], mesh), aux

    def loss_fn(params, tokens):
        lm, aux = lm_loss(params, tokens)
        stats = {
            "lm_loss": lm,
            "load_balancing_loss": aux.load_balancing_loss,
            "router_z_loss": aux.router_z_loss,
            "dropped_pairs": aux.dropped_pairs,
        }
        return lm + aux_coef * aux.load_balancing_loss + z_coef * aux.router_z_loss, stats

    eval_step = jax.jit(
        lambda params, tokens: lm_loss(params, tokens)[0], in_shardings=(state_shardings.params, batch_sharding)
    )
    train_step = training.make_train_step(loss_fn, tx, state_shardings=state_shardings, batch_sharding=batch_sharding)
    return train_step, eval_step


def evaluate(eval_step, params, eval_tokens, args, sharding) -> float:
    """Mean LM loss over `--eval-batches` fixed batches of the held-out split."""
    losses = [
        eval_step(
            params, training.global_batch(data.batch_at(eval_tokens, i, args.batch, args.seq, args.seed + 1), sharding)
        )
        for i in range(args.eval_batches)
    ]
    return float(np.mean(jax.device_get(losses)))


def dry_run(args, config) -> None:
    """`--dry-run`: the memory plan, written to OUT_DIR/memory_plan.json and printed."""
    if args.attention_impl is None and jax.default_backend() == "cpu":
        args.attention_impl = "chunked"  # XLA:CPU's attention holds [S, S] scores; GPUs run flash attention
    plan = memory_plan(args, config)
    if jax.process_index() == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "memory_plan.json"), "w") as f:
            json.dump(plan, f, indent=2)
        print(format_memory_plan(plan), flush=True)


def memory_plan(args, config) -> dict:
    """`--dry-run`: compiles the train step for the mesh and preset from shapes alone (`jax.eval_shape`,
    `ShapeDtypeStruct`s carrying the rules' shardings, `jit(...).lower(...).compile()`), nothing allocated, and
    returns XLA's per-device memory analysis with the parameter and optimizer-state shares. The figures are
    the compiler's for this platform: on host CPU devices standing in for GPUs they are estimates."""
    mesh = training.make_mesh(args.mesh_data, args.mesh_expert)
    batch_sharding = training.batch_sharding(mesh)
    workspace = model_from_flags.open_workspace(args, config, mesh, args.batch * args.seq)
    tx = model_from_flags.adamw(args, args.lr, args.warmup, args.lr_decay_steps)
    graphdef, _, state, shardings = model_from_flags.abstract_state(config, args, mesh, tx, workspace)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
    tokens = jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32, sharding=batch_sharding)
    with jax.set_mesh(mesh), workspace or contextlib.nullcontext():
        train_step, _ = make_steps(graphdef, tx, args.aux_loss_coef, args.z_loss_coef, shardings, batch_sharding)
        plan, _ = training.plan_memory(train_step, abstract, tokens, program_bytes=True)
    device = jax.devices()[0]
    return {
        "preset": args.preset,
        "layers": config.num_hidden_layers,
        "scan_layers": args.scan_layers,
        "mesh": {"data": args.mesh_data, "expert": args.mesh_expert},
        "fsdp": args.fsdp,
        "fsdp_over_expert": args.fsdp_over_expert,
        "batch": args.batch,
        "seq": args.seq,
        "tokens_per_device": args.batch * args.seq // mesh.size,
        "dtype": args.dtype,
        "param_dtype": args.param_dtype,
        "recipe": args.recipe,
        "remat": args.remat,
        "remat_save_moe": args.remat_save_moe,
        "attention_impl": args.attention_impl,
        "implementation": model_from_flags.implementation_label(args),
        "transport": args.transport,
        "platform": device.platform,
        "device_kind": device.device_kind,
        "estimate": device.platform == "cpu",
        "parameters": sum(x.size for x in jax.tree.leaves(state.params)),
        "per_device_bytes": {
            **plan.bytes,
            "params": training.shard_bytes(state.params, shardings.params),
            "optimizer_state": training.shard_bytes(state.opt_state, shardings.opt_state),
        },
        "budget_bytes": args.memory_budget_gb * GB,
        "allocator_limit_bytes": plan.allocator_limit_bytes,
        "fits": plan.fits(args.memory_budget_gb * GB),
        "lower_s": plan.lower_s,
        "compile_s": plan.compile_s,
        "program_bytes": plan.program_bytes,
    }


def format_memory_plan(plan: dict) -> str:
    """The plan as a few lines for the terminal."""
    sizes = plan["per_device_bytes"]
    mesh = plan["mesh"]
    kind = (
        f"ESTIMATE on {plan['device_kind']} host devices standing in for GPUs (XLA:CPU's memory analysis)"
        if plan["estimate"]
        else f"compiled for {plan['device_kind']}"
    )
    fsdp = ("over data x expert" if plan["fsdp_over_expert"] else "over data") if plan["fsdp"] else "off"
    lines = [
        (
            f"memory plan: {plan['preset']} ({plan['layers']} layers, {plan['parameters'] / 1e9:.2f}B parameters), "
            f"mesh data={mesh['data']} x expert={mesh['expert']}, FSDP {fsdp}, "
            f"{plan['tokens_per_device']:,} tokens per device ({plan['batch']} x {plan['seq']} global), "
            f"{plan['dtype']} compute, remat {'on' if plan['remat'] else 'off'}"
            f"{' saving the MoE residuals' if plan['remat_save_moe'] else ''}, attention "
            f"{plan['attention_impl'] or 'default'}, experts {plan['implementation']}"
        ),
        f"  {kind}",
        "  per device, GB (1e9 bytes):",
    ]
    for name in ("arguments", "outputs", "aliased", "temporaries", "generated_code"):
        lines.append(f"    {name:<16}{sizes[name] / GB:10.3f}")
    lines.append(
        f"    {'total':<16}{sizes['total'] / GB:10.3f}   (arguments + outputs - aliased + temporaries + generated code)"
    )
    lines.append(
        f"    of which parameters {sizes['params'] / GB:.3f}, optimizer state {sizes['optimizer_state'] / GB:.3f}"
    )
    verdict = "fits" if plan["fits"] else "does NOT fit"
    limit = plan["allocator_limit_bytes"]
    allocator = f" and the allocator's {limit / GB:.1f} GB (XLA_PYTHON_CLIENT_MEM_FRACTION)" if limit else ""
    lines.append(
        f"  {verdict} in {plan['budget_bytes'] / GB:.1f} GB{allocator}; lowered in {plan['lower_s']:.1f} s, "
        f"compiled in {plan['compile_s']:.1f} s"
    )
    return "\n".join(lines)


def train(args, config, train_tokens: np.ndarray, eval_tokens: np.ndarray) -> dict:
    """Runs the training; writes metrics.jsonl, loss_curve.png and summary.json to `args.out_dir`."""
    mesh = training.make_mesh(args.mesh_data, args.mesh_expert)
    batch_sharding = training.batch_sharding(mesh)
    workspace = model_from_flags.open_workspace(args, config, mesh, args.batch * args.seq)
    tx = model_from_flags.adamw(args, args.lr, args.warmup, args.lr_decay_steps)
    graphdef, create, abstract, state_shardings = model_from_flags.abstract_state(config, args, mesh, tx, workspace)
    saved = checkpoints.open_checkpoints(args)
    start = checkpoints.resume_step(saved, abstract, args.resume)
    if saved and start:
        state = saved.restore(start, abstract, state_shardings)
    else:
        state = training.init_state(create, tx, state_shardings)
    with jax.set_mesh(mesh), workspace or contextlib.nullcontext():  # the workspace is closed at the end
        train_step, eval_step = make_steps(
            graphdef, tx, args.aux_loss_coef, args.z_loss_coef, state_shardings, batch_sharding
        )

        tokens_per_step = args.batch * args.seq
        flops_per_step = training.train_flops_per_token(config, args.seq) * tokens_per_step
        peak = training.peak_flops(jax.devices()[0].device_kind, args.peak_tflops)
        peak = peak * jax.device_count() if peak else None
        is_main = jax.process_index() == 0
        log = training.MetricsLog(args.out_dir, fresh=start == 0) if is_main else None
        if is_main:
            print(
                describe_run(config, args, mesh, abstract.params, flops_per_step / tokens_per_step, start), flush=True
            )

        # Compiled ahead of the loop: its time and XLA's memory plan go into summary.json, beside the measured
        # step times and peak memory.
        first = data.batch_at(train_tokens, start + 1, args.batch, args.seq, args.seed)
        plan, train_step = training.plan_memory(train_step, state, training.global_batch(first, batch_sharding))
        compile_s, planned = plan.lower_s + plan.compile_s, plan.bytes
        if is_main:
            print(
                f"train step compiled in {compile_s:.1f} s; XLA's memory plan: {planned['total'] / GB:.2f} GB per "
                f"device",
                flush=True,
            )

        step_times, last_eval = [], None
        bar = tqdm(
            range(start + 1, args.steps + 1), initial=start, total=args.steps, disable=not is_main, dynamic_ncols=True
        )
        for step in bar:
            tokens = data.batch_at(train_tokens, step, args.batch, args.seq, args.seed)
            batch = training.global_batch(tokens, batch_sharding)
            began = time.perf_counter()
            state, stats = train_step(state, batch)
            stats = {k: v.item() for k, v in jax.device_get(stats).items()}
            seconds = time.perf_counter() - began
            if step > start + 2:  # skip compilation and warm-up steps in the throughput figures
                step_times.append(seconds)
            record = {"step": step, **stats, "step_time_s": seconds, "tokens_per_s": tokens_per_step / seconds}
            if peak:
                record["mfu"] = flops_per_step / seconds / peak
            if not (math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])):
                raise cli.RunError(
                    f"at step {step} the loss is {stats['loss']:.4g} and the gradient norm {stats['grad_norm']:.4g}: "
                    f"lower --lr (now {args.lr}) or raise --warmup (now {args.warmup})"
                )
            if step % args.eval_every == 0 or step == args.steps:
                last_eval = record["eval_loss"] = evaluate(eval_step, state.params, eval_tokens, args, batch_sharding)
            if saved:
                saved.save(step, state, force=step == args.steps)
            if log:
                log.write(record)
                bar.set_postfix(progress_fields(record, last_eval), refresh=False)
        if saved:
            saved.wait_until_finished()
        if args.save_model:
            model_from_flags.save_model(graphdef, state.params, os.path.join(args.out_dir, model_from_flags.MODEL_DIR))

    if log is None:  # processes other than 0
        return {}
    log.close()
    summary = summarize(args, config, log.path, step_times, tokens_per_step, flops_per_step, peak)
    summary.update(compile_s=compile_s, planned_memory_bytes=planned)
    training.plot_loss_curves(
        {model_from_flags.implementation_label(args): training.read_metrics(log.path)},
        os.path.join(args.out_dir, "loss_curve.png"),
    )
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def progress_fields(record: dict, last_eval: float | None) -> dict:
    fields = {"loss": f"{record['lm_loss']:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
    if "mfu" in record:
        fields["MFU"] = f"{100 * record['mfu']:.1f}%"
    if last_eval is not None:
        fields["eval"] = f"{last_eval:.3f}"
    return fields


def describe_run(config, args, mesh, params, flops_per_token: float, start: int) -> str:
    num_params = sum(x.size for x in jax.tree.leaves(params))
    implementation = model_from_flags.implementation_label(args)
    return (
        f"Qwen3-MoE {args.preset}: {num_params / 1e6:.1f}M parameters, {config.num_hidden_layers} layers, "
        f"{config.num_experts} experts top-{config.num_experts_per_tok}\n"
        f"mesh data={mesh.shape['data']} x expert={mesh.shape['expert']} on {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s); MoE implementation {implementation}; compute {args.dtype}; "
        f"batch {args.batch} x seq {args.seq}; {flops_per_token / 1e6:.1f} MFLOP/token"
        + (f"; resuming after step {start}" if start else "")
    )


def summarize(args, config, metrics_path, step_times, tokens_per_step, flops_per_step, peak) -> dict:
    records = training.read_metrics(metrics_path)
    median = float(np.median(step_times)) if step_times else None
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    return {
        "preset": args.preset,
        "implementation": args.implementation,
        "transport": args.transport,
        "dtype": args.dtype,
        "param_dtype": args.param_dtype,
        "recipe": args.recipe,
        "steps": args.steps,
        "batch": args.batch,
        "seq": args.seq,
        "layers": config.num_hidden_layers,
        "scan_layers": args.scan_layers,
        "fsdp": args.fsdp,
        "remat": args.remat,
        "remat_save_moe": args.remat_save_moe,
        "mesh": {"data": args.mesh_data, "expert": args.mesh_expert},
        "device": jax.devices()[0].device_kind,
        "num_devices": jax.device_count(),
        "median_step_time_s": median,
        "tokens_per_s": tokens_per_step / median if median else None,
        "mfu": flops_per_step / median / peak if (median and peak) else None,
        "peak_memory_bytes": training.peak_memory_bytes(),
        "first_loss": records[0]["lm_loss"] if records else None,
        "final_loss": float(np.mean([r["lm_loss"] for r in records[-FINAL_WINDOW:]])) if records else None,
        "final_eval_loss": evals[-1] if evals else None,
        "config": config.to_dict(),
    }
