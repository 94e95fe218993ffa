"""The loop of examples/rl_qwen3_moe.py: GRPO on one model and one set of kernels for sampling and training.

Each step draws `--prompts` problems, samples `--group` completions of each with `qwen3_moe.generate`, scores them
with the task's reward, and takes `--minibatches` x `--epochs` optimizer steps on GRPO's loss over the packed
rollouts (`jax_megamoe.rl`; the text side in rollouts.py). Before the first step an optional supervised warm-up
trains on the task's answers; the policy it leaves is the KL reference. The mesh, sharding, optimizer and
checkpoints are the training job's (`jax_megamoe.training`, model_from_flags.py, checkpoints.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jax_megamoe import cli, rl, training
from jax_megamoe.models import qwen3_moe
from jax_megamoe.models.generation import prompt_bucket
from jax_megamoe.training import TrainState
from moe_training import checkpoints, metrics, model_from_flags, rollouts, tasks
from moe_training.tokenizer import Tokenizer

FINAL_WINDOW = 5  # summary.json's final_reward: mean reward of the last steps


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RLState:
    """What a checkpoint holds: the policy, its optimizer state, the KL reference (None without a KL term; its
    matrices in the compute dtype, all its forward reads) and the sampler's random key (as key data)."""

    params: nnx.State
    opt_state: optax.OptState
    reference: nnx.State | None
    rng: Any  # key data (its sharding in a tree of shardings)


@dataclasses.dataclass
class Setup:
    """The mesh, the model's structure and shardings, and the jitted steps of a run."""

    mesh: jax.sharding.Mesh
    rows: NamedSharding  # rollouts split by row over the whole mesh
    graphdef: nnx.GraphDef
    shardings: TrainState
    policy_step: Callable  # (TrainState, Rollouts) -> (TrainState, stats): GRPO's
    warmup_step: Callable  # the same for the supervised warm-up
    logprobs: Callable  # (params, tokens [R, S], routing or None) -> [R, S-1] log-probs of tokens[:, 1:]

    def put(self, batch: rl.Rollouts) -> rl.Rollouts:
        return jax.tree.map(lambda x: training.global_batch(x, self.rows), batch)


def make_setup(args, config, mesh, tx, warmup_tx, workspace) -> tuple[Setup, object, RLState, RLState]:
    """`(Setup, create, the RLState's shapes, its shardings)`: `create()` builds the model the flags describe."""
    graphdef, create, train_state, shardings = model_from_flags.abstract_state(config, args, mesh, tx, workspace)
    rows = training.batch_sharding(mesh)
    grpo = rl.GRPOConfig(
        clip_epsilon=args.clip_epsilon,
        kl_coef=args.kl_coef,
        behaviour=args.behaviour,
        tis_cap=args.tis_cap,
        mask_band=tuple(args.mask_band) if args.mask_band else None,
    )

    def with_router_losses(loss, aux):
        return loss + args.aux_loss_coef * aux.load_balancing_loss + args.z_loss_coef * aux.router_z_loss

    def replayed(batch):  # the sampler's routing record, where the trainer replays it
        return batch.routing if args.routing_replay else None

    def policy_loss(params, batch):
        model = nnx.merge(graphdef, params)
        logprobs, aux = rl.sequence_logprobs(model, batch.tokens, routing=replayed(batch), return_routing=True)
        loss, stats = rl.grpo_loss(logprobs, batch, grpo)
        assert aux.routing is not None  # return_routing
        stats["routing_mismatch"] = rl.routing_mismatch(batch.routing[:, :-1], aux.routing)
        return with_router_losses(loss, aux), {"policy_loss": loss, **stats}

    def warmup_loss(params, batch):
        logprobs, aux = rl.sequence_logprobs(nnx.merge(graphdef, params), batch.tokens)
        nll = -rl.masked_mean(logprobs, batch.mask)
        return with_router_losses(nll, aux), {"nll": nll}

    logprobs = jax.jit(
        lambda params, tokens, routing: rl.sequence_logprobs(nnx.merge(graphdef, params), tokens, routing=routing)[0],
        in_shardings=(shardings.params, rows, rows),
    )
    setup = Setup(
        mesh,
        rows,
        graphdef,
        shardings,
        training.make_train_step(policy_loss, tx, state_shardings=shardings, batch_sharding=rows),
        training.make_train_step(warmup_loss, warmup_tx, state_shardings=shardings, batch_sharding=rows),
        logprobs,
    )
    reference = jax.eval_shape(
        lambda p: qwen3_moe.compute_form(p, np.dtype(args.dtype), gather=False), train_state.params
    )
    abstract = RLState(
        train_state.params,
        train_state.opt_state,
        reference if args.kl_coef else None,
        jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))),
    )
    state_shardings = RLState(
        shardings.params, shardings.opt_state, shardings.params if args.kl_coef else None, NamedSharding(mesh, P())
    )
    return setup, create, abstract, state_shardings


def initial_params(args, setup: Setup, create, workspace):
    """The starting policy: `--init`'s checkpoint read into the mesh's shardings, or the preset's random weights."""
    if args.init:
        model = qwen3_moe.from_pretrained(
            args.init,
            mesh=setup.mesh,
            fsdp=args.fsdp,
            fsdp_over_expert=args.fsdp_over_expert,
            **model_from_flags.model_options(args, workspace),
        )
        return jax.device_put(nnx.state(model, nnx.Param), setup.shardings.params)
    return jax.jit(lambda: nnx.state(create(), nnx.Param), out_shardings=setup.shardings.params)()


def to_host(tree):
    """Global arrays as numpy arrays on every process."""
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


class Sampler:
    """`qwen3_moe.generate` on the policy for the task's prompts: a group of samples per prompt for training,
    greedy completions of the held-out problems for evaluation."""

    def __init__(self, args, setup: Setup, task: tasks.Task, tokenizer: Tokenizer):
        self.args, self.setup, self.task, self.tokenizer = args, setup, task, tokenizer
        held_out = tasks.draw_problems(task, np.random.default_rng(args.seed + 1), args.eval_problems, evaluation=True)
        self.held_out = (held_out, *rollouts.encode_prompts(held_out, tokenizer, args.prompt_width))

    def generate(self, params, prompt_ids, prompt_lengths, *, temperature: float, key=None, routing: bool = True):
        """`(tokens, logprobs, lengths, routing record or None)` on the host; `routing`: record it (the training
        samples' mismatch and replay need it, the greedy evaluation does not)."""
        out = qwen3_moe.generate(
            nnx.merge(self.setup.graphdef, params),
            prompt_ids,
            prompt_lengths=prompt_lengths,
            max_new_tokens=self.args.max_new_tokens,
            temperature=temperature,
            top_k=self.args.top_k if temperature else None,
            top_p=self.args.top_p if temperature else None,
            eos_token_id=self.tokenizer.end_id,
            pad_token_id=0,
            key=key,
            return_routing=routing,
        )
        return to_host((out.tokens, out.logprobs, out.lengths, out.routing))

    def evaluate(self, params) -> dict:
        """Greedy completions of the held-out problems: the share judged correct, and the mean reward."""
        problems, prompt_ids, prompt_lengths = self.held_out
        tokens, _, lengths, _ = self.generate(params, prompt_ids, prompt_lengths, temperature=0.0, routing=False)
        scores = rl.group_rewards(self.task.reward, problems, rollouts.completions(tokens, lengths, self.tokenizer), 1)
        return {"accuracy": float(np.mean(scores >= self.task.accuracy_threshold)), "eval_reward": float(scores.mean())}


def warm_up(args, setup: Setup, task, tokenizer: Tokenizer, params, warmup_tx) -> tuple[nnx.State, float | None]:
    """`--sft-steps` supervised steps on the task's answers (the loss on the answer and end tokens only)."""
    if not args.sft_steps:
        return params, None
    state = TrainState.create(params, warmup_tx, setup.shardings.opt_state)
    rows = args.prompts * args.group // args.minibatches  # the policy step's batch shape
    for step in tqdm(range(1, args.sft_steps + 1), desc="warm-up", disable=jax.process_index() != 0):
        problems = tasks.draw_problems(task, np.random.default_rng([args.seed, 0, step]), rows)
        batch = rollouts.demonstrations(problems, tokenizer, args.prompt_width, args.max_new_tokens)
        state, stats = setup.warmup_step(state, setup.put(batch))
    return state.params, float(stats["nll"])


# The sampler/trainer mismatch, taken at the first update of a step, when the policy is still the sampler's.
MISMATCH = ("log_ratio_max", "log_ratio_mean", "log_ratio_p99", "sampler_kl", "routing_mismatch", "tis_truncated")


def policy_update(args, setup: Setup, state: RLState, batch: rl.Rollouts) -> tuple[RLState, dict]:
    """`--epochs` passes over `--minibatches` slices of the step's rollouts, one optimizer step each. The
    statistics: means over the updates, and the sampler/trainer mismatch at the first update (`MISMATCH`); with
    `--behaviour trainer` the seconds of the forward that recomputes the behaviour log-probs first."""
    size = len(batch.tokens) // args.minibatches
    minibatches, recomputed_s = [], 0.0
    for i in range(args.minibatches):
        minibatch = setup.put(batch.rows(slice(i * size, (i + 1) * size)))
        routing = minibatch.routing if args.routing_replay else None
        if state.reference is not None:
            reference = setup.logprobs(state.reference, minibatch.tokens, routing)
            minibatch = dataclasses.replace(minibatch, reference_logprobs=reference)
        if args.behaviour == "trainer":
            began = time.perf_counter()
            trainer_logprobs = jax.block_until_ready(setup.logprobs(state.params, minibatch.tokens, routing))
            recomputed_s += time.perf_counter() - began
            minibatch = dataclasses.replace(minibatch, trainer_logprobs=trainer_logprobs)
        minibatches.append(minibatch)
    train_state, updates = TrainState(state.params, state.opt_state), []
    for _ in range(args.epochs):
        for minibatch in minibatches:
            train_state, stats = setup.policy_step(train_state, minibatch)
            updates.append(stats)
    updates = [{k: float(v) for k, v in u.items()} for u in jax.device_get(updates)]
    first = {k: v for k, v in updates[0].items() if k in MISMATCH}
    means = {k: float(np.mean([u[k] for u in updates])) for k in updates[0] if k not in MISMATCH}
    if args.behaviour == "trainer":
        means["recompute_time_s"] = recomputed_s
    return dataclasses.replace(state, params=train_state.params, opt_state=train_state.opt_state), {**means, **first}


def rl_step(args, setup: Setup, sampler: Sampler, state: RLState, step: int) -> tuple[RLState, dict]:
    """One GRPO step: sample, score, update. Returns the new state and the step's record."""
    began = time.perf_counter()
    problems = tasks.draw_problems(sampler.task, np.random.default_rng([args.seed, step]), args.prompts)
    prompt_ids, prompt_lengths = rollouts.encode_prompts(problems, sampler.tokenizer, args.prompt_width, args.group)
    rng, key = jax.random.split(jax.random.wrap_key_data(state.rng))
    tokens, logprobs, lengths, routing = sampler.generate(
        state.params, prompt_ids, prompt_lengths, temperature=args.temperature, key=key
    )
    sampled = time.perf_counter()
    texts = rollouts.completions(tokens, lengths, sampler.tokenizer)
    scores = rl.group_rewards(sampler.task.reward, problems, texts, args.group)
    advantages = rl.group_advantages(scores)
    batch = rl.pack(prompt_ids, prompt_lengths, tokens, lengths, logprobs, advantages, routing=routing)
    scored = time.perf_counter()
    state, stats = policy_update(args, setup, state, batch)
    trained = time.perf_counter()
    state = dataclasses.replace(state, rng=jax.random.key_data(rng))
    sample_s, train_s = sampled - began, trained - scored
    record = {
        "step": step,
        "reward": float(scores.mean()),
        "completion_tokens": float(lengths.mean()),
        **stats,
        "sample_time_s": sample_s,
        "train_time_s": train_s,
        "step_time_s": trained - began,
        "sampled_tokens_per_s": float(lengths.sum()) / sample_s,
        "trained_tokens_per_s": batch.tokens.size * args.epochs / train_s,
    }
    return state, record


def describe_run(args, config, mesh, params, task, reference_bytes: int | None, start: int) -> str:
    params = sum(x.size for x in jax.tree.leaves(params))
    reference = (
        f"KL reference {reference_bytes / 1e6:,.1f} MB per device (--kl-coef {args.kl_coef})"
        if reference_bytes is not None
        else "no KL reference (--kl-coef 0)"
    )
    return (
        f"GRPO on Qwen3-MoE {args.init or args.preset}: {params / 1e6:.1f}M parameters, {config.num_hidden_layers} "
        f"layers, {config.num_experts} experts top-{config.num_experts_per_tok}; task {task.name}\n"
        f"mesh data={mesh.shape['data']} x expert={mesh.shape['expert']} on {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s); MoE implementation {model_from_flags.implementation_label(args)}; "
        f"compute {args.dtype}; {args.prompts} prompts x {args.group} samples per step, {args.max_new_tokens} new "
        f"tokens; {reference}" + (f"; resuming after step {start}" if start else "")
    )


def train(args, config, task: tasks.Task, tokenizer: Tokenizer) -> dict:
    """Runs the warm-up and the GRPO steps; writes metrics.jsonl, rl_curve.png, summary.json and the final model
    (`model/`, Hugging Face layout) to `args.out_dir`. Returns the summary (empty on processes other than 0)."""
    mesh = training.make_mesh(args.mesh_data, args.mesh_expert)
    # The model's largest calls: prefill of the prompts (padded to generate's bucket), a minibatch's forward.
    rollouts_per_step, bucket = args.prompts * args.group, prompt_bucket(args.prompt_width)
    tokens_per_call = max(
        max(rollouts_per_step, args.eval_problems) * bucket,
        rollouts_per_step // args.minibatches * (args.prompt_width + args.max_new_tokens),
    )
    workspace = model_from_flags.open_workspace(args, config, mesh, tokens_per_call)
    tx = model_from_flags.adamw(args, args.lr, args.warmup, args.lr_decay_steps)
    warmup_tx = model_from_flags.adamw(args, args.sft_lr, 0, max(args.sft_steps, 1))
    is_main = jax.process_index() == 0
    with jax.set_mesh(mesh), workspace or contextlib.nullcontext():  # the workspace is closed at the end
        setup, create, abstract, shardings = make_setup(args, config, mesh, tx, warmup_tx, workspace)
        sampler = Sampler(args, setup, task, tokenizer)
        saved = checkpoints.open_checkpoints(args)
        start = checkpoints.resume_step(saved, abstract, args.resume)
        reference_bytes = training.shard_bytes(abstract.reference, shardings.reference) if args.kl_coef else None
        if is_main:
            print(describe_run(args, config, mesh, abstract.params, task, reference_bytes, start), flush=True)
        log = training.MetricsLog(args.out_dir, fresh=start == 0) if is_main else None
        if saved and start:
            state = saved.restore(start, abstract, shardings)
        else:
            params, warmup_nll = warm_up(
                args, setup, task, tokenizer, initial_params(args, setup, create, workspace), warmup_tx
            )
            state = new_rl_state(args, setup, params, tx)
            record = {"step": 0, **sampler.evaluate(state.params)}
            if warmup_nll is not None:
                record["warmup_nll"] = warmup_nll
            if log:
                log.write(record)
                print(f"starting policy: held-out accuracy {record['accuracy']:.1%}", flush=True)

        step_records = []
        bar = tqdm(range(start + 1, args.steps + 1), initial=start, total=args.steps, disable=not is_main)
        for step in bar:
            state, record = rl_step(args, setup, sampler, state, step)
            if step % args.eval_every == 0 or step == args.steps:
                record.update(sampler.evaluate(state.params))
            if not math.isfinite(record["loss"]):
                raise cli.RunError(f"the loss became {record['loss']} at step {step}: lower --lr (now {args.lr})")
            if saved:
                saved.save(step, state, force=step == args.steps)
            step_records.append(record)
            if log:
                log.write(record)
                bar.set_postfix(progress_fields(record), refresh=False)
        if saved:
            saved.wait_until_finished()
        model_dir = os.path.join(args.out_dir, model_from_flags.MODEL_DIR)
        model_from_flags.save_model(setup.graphdef, state.params, model_dir)

    if log is None:  # processes other than 0
        return {}
    log.close()
    records = training.read_metrics(log.path)
    metrics.plot_rl_curves(records, os.path.join(args.out_dir, "rl_curve.png"))
    metrics.plot_mismatch(records, os.path.join(args.out_dir, "mismatch_curve.png"))
    model = nnx.merge(setup.graphdef, abstract.params)
    summary = summarize(args, config, task, model, records, step_records, reference_bytes, model_dir)
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def new_rl_state(args, setup: Setup, params, tx) -> RLState:
    """The GRPO state from the starting policy: a fresh optimizer, the reference a copy of the policy in the
    compute dtype where the loss has a KL term, the sampler's key from `--seed`."""
    state = TrainState.create(params, tx, setup.shardings.opt_state)
    reference = None
    if args.kl_coef:
        reference = jax.jit(
            lambda p: qwen3_moe.compute_form(p, np.dtype(args.dtype), gather=False),
            out_shardings=setup.shardings.params,
        )(params)
    return RLState(state.params, state.opt_state, reference, jax.random.key_data(jax.random.key(args.seed)))


def progress_fields(record: dict) -> dict:
    fields = {"reward": f"{record['reward']:.3f}"}
    if "accuracy" in record:
        fields["acc"] = f"{record['accuracy']:.1%}"
    if "kl" in record:
        fields["kl"] = f"{record['kl']:.4f}"
    fields["sample tok/s"] = f"{record['sampled_tokens_per_s']:,.0f}"
    return fields


def format_summary(summary: dict) -> str:
    """The run in a line: accuracy and reward from start to end, the median step's sampling and training (time and
    tokens/s), peak device memory."""

    def number(key, spec):
        return "n/a" if summary[key] is None else format(summary[key], spec)

    peak = summary["peak_memory_bytes"]
    return (
        f"held-out accuracy {number('start_accuracy', '.1%')} -> {number('final_accuracy', '.1%')}; reward "
        f"{number('first_reward', '.3f')} -> {number('final_reward', '.3f')}; per step: sampling "
        f"{number('median_sample_time_s', '.2f')} s ({number('median_sampled_tokens_per_s', ',.0f')} tokens/s), "
        f"training {number('median_train_time_s', '.2f')} s ({number('median_trained_tokens_per_s', ',.0f')} "
        f"tokens/s); peak memory {'n/a' if peak is None else f'{peak / 1e9:.2f} GB'}"
    )


def summarize(args, config, task, model, records, step_records, reference_bytes, model_dir) -> dict:
    evals = [r for r in records if "accuracy" in r]
    timed = step_records[1:] or step_records  # the first step compiles
    median = {key: float(np.median([r[key] for r in timed])) if timed else None for key in TIMED}
    steps = [r for r in records if r["step"] > 0]
    return {
        "preset": args.preset,
        "init": args.init,
        "task": task.name,
        "steps": args.steps,
        "prompts": args.prompts,
        "group": args.group,
        "max_new_tokens": args.max_new_tokens,
        "minibatches": args.minibatches,
        "epochs": args.epochs,
        "kl_coef": args.kl_coef,
        "routing_replay": args.routing_replay,
        "behaviour": args.behaviour,
        "tis_cap": args.tis_cap if args.behaviour == "trainer" else None,
        "mask_band": args.mask_band,
        "sft_steps": args.sft_steps,
        "dtype": args.dtype,
        "param_dtype": args.param_dtype,
        "implementation": model_from_flags.implementation_label(args),
        "transport": args.transport,
        "mesh": {"data": args.mesh_data, "expert": args.mesh_expert},
        "fsdp": args.fsdp,
        "device": jax.devices()[0].device_kind,
        "num_devices": jax.device_count(),
        "start_accuracy": evals[0]["accuracy"] if evals else None,
        "final_accuracy": evals[-1]["accuracy"] if evals else None,
        "first_reward": steps[0]["reward"] if steps else None,
        "final_reward": float(np.mean([r["reward"] for r in steps[-FINAL_WINDOW:]])) if steps else None,
        "max_log_ratio_at_first_update": max((r["log_ratio_max"] for r in steps), default=None),
        **{
            f"median_{key}_at_first_update": float(np.median([r[key] for r in steps])) if steps else None
            for key in ("log_ratio_p99", "sampler_kl", "routing_mismatch")
        },
        **{f"median_{key}": value for key, value in median.items()},
        "peak_memory_bytes": training.peak_memory_bytes(),
        "generate_programs": qwen3_moe.compiled_programs(),
        "kv_cache_bytes": qwen3_moe.generation_plan(
            model, args.prompts * args.group, args.prompt_width, args.max_new_tokens
        ).cache_bytes,
        "reference_bytes_per_device": reference_bytes,
        "model_dir": model_dir,
        "config": config.to_dict(),
    }


TIMED = ("sample_time_s", "train_time_s", "step_time_s", "sampled_tokens_per_s", "trained_tokens_per_s")
