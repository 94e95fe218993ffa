"""GRPO with tunix on jax_megamoe's Qwen3-MoE: tunix's usual RLCluster / GRPOLearner code, two lines changed.

    python examples/tunix_grpo_qwen3_moe.py runs/train_qwen3_moe/model     # the training job's tiny byte model
    python examples/tunix_grpo_qwen3_moe.py path/to/Qwen3-30B-A3B --dtype bfloat16 --steps 100

The reward is a toy one: the share of digits among each completion's tokens. Needs the extra
(`pip install 'jax_megamoe[tunix]'`); docs/tunix.md explains each part.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

from jax_megamoe.integrations import tunix as megamoe

MAX_NEW_TOKENS = 4
PROMPTS = ["a: ", "b: ", "c: ", "d: "]


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="a Hugging Face Qwen3-MoE directory (config.json, safetensors, tokenizer)")
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps (default 30)")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam's learning rate (default 1e-2)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype")
    args = parser.parse_args(argv)

    # The experts over every device: expert parallelism on a GPU host, one device on a plain CPU. jax_megamoe's
    # layers shard through sharding constraints, so the mesh's axes are Auto (jax.make_mesh's default is Explicit).
    mesh = jax.make_mesh((1, jax.device_count()), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    # Line 1 of 2: the actor is jax_megamoe's Qwen3-MoE (tunix's: qwen3 params.create_model_from_safe_tensors).
    actor = megamoe.from_pretrained(args.model_dir, mesh=mesh, dtype=jnp.dtype(args.dtype), param_dtype=jnp.float32)
    tokenizer = megamoe.load_tokenizer(args.model_dir)  # the directory's tokenizer, or bytes for the tiny preset

    cluster = rl_cluster_lib.RLCluster(
        actor=actor,
        tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in rl_cluster_lib.Role},
            rollout_engine=megamoe.MegaMoeRollout,  # Line 2 of 2: was "vanilla"
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.adam(args.lr),
                eval_every_n_steps=args.steps + 1,
                max_steps=args.steps,
                data_sharding_axis=("data",),
            ),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=MAX_NEW_TOKENS, max_prompt_length=8, temperature=1.0
            ),
        ),
    )

    rewards: list[float] = []

    def digit_share(prompts, completions, **kwargs) -> list[float]:
        scores = [sum(c.isdigit() for c in text) / MAX_NEW_TOKENS for text in completions]
        rewards.append(float(np.mean(scores)))
        print(f"step {len(rewards)}: mean reward {rewards[-1]:.3f}", flush=True)
        return scores

    learner = grpo_learner.GRPOLearner(
        cluster, grpo_learner.GRPOConfig(num_generations=8, num_iterations=1, beta=0.0), reward_fns=digit_share
    )
    start = time.perf_counter()
    learner.train([{"prompts": np.array(PROMPTS)}] * args.steps)
    seconds = time.perf_counter() - start
    print(f"mean reward {rewards[0]:.3f} -> {rewards[-1]:.3f} in {len(rewards)} steps, {seconds:.1f} s")
    return rewards


if __name__ == "__main__":
    main()
