"""The RL job, examples/rl_qwen3_moe.py: run as users run it (a subprocess on 8 host CPU devices), GRPO raises a
learnable reward while the sampler's log-probs are the trainer's at the first update of every batch, and resuming
from a checkpoint reproduces the uninterrupted run; its parts (tasks, rollouts, the GRPO loss) on small cases; bad
flags get one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from job_cli import assert_usage_error, help_entries

from jax_megamoe.models import qwen3_moe

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "rl_qwen3_moe.py"
sys.path.insert(0, str(SCRIPT.parent))
from moe_training import grpo, rollouts, tasks  # noqa: E402  (the example's package; path set above)

# A reward a random tiny model learns in a few steps: the share of digits in its completions (about 4% at random).
LEARNABLE = [
    "--task", "synthetic", "--prompt-len", "6", "--max-new-tokens", "6", "--prompts", "8", "--group", "8",
    "--minibatches", "2", "--steps", "20", "--lr", "3e-3", "--sft-steps", "0", "--kl-coef", "0.01",
    "--eval-problems", "8", "--eval-every", "100", "--dtype", "float32", "--seed", "0",
]  # fmt: skip
DETERMINISTIC = ("reward", "loss", "policy_loss", "kl", "clip_fraction", "grad_norm", "log_ratio_max", "accuracy")


def run(*args, check=True):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def records(out_dir: Path) -> list[dict]:
    with open(out_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_grpo_raises_the_reward_the_sampler_agrees_and_resume_reproduces(tmp_path):
    full, resumed, ckpt = tmp_path / "full", tmp_path / "resumed", tmp_path / "ckpt"
    run(*LEARNABLE, "--out-dir", str(full), "--ckpt-dir", str(ckpt), "--ckpt-every", "10")
    start, *steps = records(full)
    assert start["step"] == 0 and "accuracy" in start and [r["step"] for r in steps] == list(range(1, 21))
    rewards = [r["reward"] for r in steps]
    assert np.mean(rewards[-5:]) > 2 * np.mean(rewards[:5]), rewards
    # float32 on CPU: at the first update of each batch the trainer's log-probs of the sampled tokens are the
    # sampler's, |ratio - 1| <= 1e-5 (|log ratio| <= 1e-5 says the same to first order).
    for r in steps:
        assert 0 <= r["log_ratio_p99"] <= r["log_ratio_max"] <= 1e-5, r
        assert r["kl"] >= 0 and 0 <= r["clip_fraction"] <= 1
    assert steps[-1]["kl"] > 0  # the policy moved away from the reference
    summary = json.loads((full / "summary.json").read_text())
    assert summary["mesh"] == {"data": 2, "expert": 4} and summary["reference_bytes_per_device"] > 0
    assert summary["final_reward"] == pytest.approx(np.mean(rewards[-5:]))
    assert (full / "rl_curve.png").stat().st_size > 0 and (full / "model" / "config.json").exists()

    # Resume from step 10's checkpoint: the policy, the KL reference, AdamW's moments and the sampler's key come back,
    # so steps 11-20 repeat bit for bit.
    shutil.rmtree(ckpt / "20")
    run(*LEARNABLE, "--out-dir", str(resumed), "--ckpt-dir", str(ckpt), "--ckpt-every", "10", "--resume")
    again = records(resumed)
    assert [r["step"] for r in again] == list(range(11, 21))
    for first, second in zip(steps[10:], again, strict=True):
        assert {k: first.get(k) for k in DETERMINISTIC} == {k: second.get(k) for k in DETERMINISTIC}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--group", "1"], "--group must be >= 2"),
        (["--prompts", "3", "--group", "3"], "--minibatches 4 must divide the 9 samples"),
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--temperature", "nan"], "--temperature must be > 0"),
        # Numbers that only make sense positive, or not negative.
        (["--lr", "-1"], "--lr must be > 0, got -1.0"),
        (["--sft-lr", "0"], "--sft-lr must be > 0, got 0.0"),
        (["--clip-epsilon", "0"], "--clip-epsilon must be > 0, got 0.0"),
        (["--grad-clip", "inf"], "--grad-clip must be a finite number, got inf"),
        (["--kl-coef", "-0.01"], "--kl-coef must be >= 0, got -0.01"),
        (["--sft-steps", "-1"], "--sft-steps must be >= 0, got -1"),
        (["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--resume"], "--resume needs --ckpt-dir"),
        (["--init", "/no/such/dir"], "--init: no config.json"),
        (["--task", "synthetic", "--sft-steps", "3"], "--task synthetic has no answers to warm up on"),
        (["--prompts", "3", "--group", "2", "--minibatches", "1"], "must be divisible by the 8 devices"),
    ],
)
def test_bad_flags_exit_2_with_one_line(args, message):
    result = run(*args, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("rl_qwen3_moe.py: error: ") and message in last, result.stderr[-2000:]


def test_help_explains_every_flag_its_default_and_each_task_s_reward():
    entries = help_entries(run("--help").stdout)
    assert len(entries) > 40 and all(entries.values()), [flag for flag, text in entries.items() if not text]
    for flag, default in (("--z-loss-coef", "0.0"), ("--seed", "0"), ("--weight-decay", "0.0"), ("--epochs", "1")):
        assert entries[flag].endswith(f"(default: {default})"), entries[flag]
    task = entries["--task"]
    assert all(f"{name}:" in task for name in ("reverse", "add", "synthetic")) and task.count("rewarded with") == 2


def test_resuming_from_a_directory_that_does_not_exist_creates_nothing(tmp_path):
    result = run("--resume", "--ckpt-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path / "out"), check=False)
    assert_usage_error(result, SCRIPT.name, f"--resume: --ckpt-dir {tmp_path / 'ckpt'} does not exist")
    assert not list(tmp_path.iterdir())


def test_init_without_weights_is_a_usage_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(qwen3_moe.tiny().to_dict()))
    error = "--init: no weights (model.safetensors or model.safetensors.index.json) in"
    assert_usage_error(run("--init", str(tmp_path), check=False), SCRIPT.name, error)


def test_tasks_hold_out_their_evaluation_problems_and_score_digits_in_place():
    task = tasks.reverse_digits(3)
    held_out = tasks.draw_problems(task, np.random.default_rng(0), 64, evaluation=True)
    training = tasks.draw_problems(task, np.random.default_rng(1), 2000)
    assert len(set(held_out)) == 64 and not set(held_out) & set(training)
    assert all(p.answer == p.prompt[:-1][::-1] for p in training)
    add = tasks.draw_problems(tasks.add_numbers(2), np.random.default_rng(2), 50)
    assert all(int(p.answer) == sum(map(int, p.prompt[:-1].split("+"))) for p in add)

    problem = tasks.Problem("123=", "321")
    score = task.reward
    assert score(problem, "321", True) == 1.0
    assert score(problem, "321", False) == 0.0  # no end token within the budget
    assert score(problem, "324", True) == pytest.approx(2 / 3)
    assert score(problem, "3210", True) == pytest.approx(3 / 4)
    assert score(problem, "", True) == 0.0


class Bytes:
    end_id = ord("\n")

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(int(i) for i in ids).decode()


def test_pack_puts_each_completion_behind_its_prompt_at_the_sampled_positions():
    prompt_ids, prompt_lengths = rollouts.encode_prompts(
        [tasks.Problem("ab", ""), tasks.Problem("cde", "")], Bytes(), width=4
    )
    tokens = np.array([[1, 2, 3], [4, 5, 0]], np.int32)  # row 1 stopped after two tokens (padding after)
    lengths = np.array([3, 2], np.int32)
    logprobs = np.array([[-0.1, -0.2, -0.3], [-0.4, -0.5, 0.0]], np.float32)
    packed = rollouts.pack(prompt_ids, prompt_lengths, tokens, lengths, logprobs, np.array([1.0, -1.0]))
    a, b, c, d, e = (ord(x) for x in "abcde")
    np.testing.assert_array_equal(packed.tokens, [[a, b, 1, 2, 3, 0, 0], [c, d, e, 4, 5, 0, 0]])
    # targets are tokens[:, 1:]: the completion's first token is predicted from the prompt's last
    np.testing.assert_array_equal(packed.mask, [[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0]])
    np.testing.assert_allclose(packed.sampler_logprobs, [[0, -0.1, -0.2, -0.3, 0, 0], [0, 0, -0.4, -0.5, 0, 0]])
    np.testing.assert_array_equal(packed.advantages, [1.0, -1.0])

    texts = rollouts.completions(np.array([[52, 50, 10, 0], [52, 50, 51, 53]]), np.array([3, 4]), Bytes())
    assert texts == [("42", True), ("4235", False)]
    demos = rollouts.demonstrations([tasks.Problem("12=", "21")], Bytes(), width=3, new_tokens=4)
    np.testing.assert_array_equal(demos.tokens[0], [ord(x) for x in "12=21\n"] + [0])
    np.testing.assert_array_equal(demos.mask[0], [0, 0, 1, 1, 1, 0])


def test_group_advantages_are_normalised_within_each_group():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.2, 0.4, 0.6]], np.float32)
    advantages = rollouts.group_advantages(rewards).reshape(3, 4)
    np.testing.assert_allclose(advantages.mean(axis=1), 0, atol=1e-6)
    np.testing.assert_allclose(advantages[0], [1, -1, -1, 1], atol=1e-3)
    np.testing.assert_array_equal(advantages[1], 0)  # nothing to learn from a group that scores alike
    np.testing.assert_allclose(advantages[2].std(), 1, atol=1e-3)


def batch(logprobs, advantages, mask, reference=None):
    return rollouts.Rollouts(
        tokens=np.zeros(mask.shape, np.int32),
        mask=mask,
        sampler_logprobs=logprobs,
        advantages=advantages,
        reference_logprobs=reference,
    )


def test_grpo_loss_clips_the_ratio_and_penalises_the_kl():
    sampled = np.array([[-1.0, -2.0, -3.0], [-1.5, -0.5, -9.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
    advantages = np.array([2.0, -1.0], np.float32)
    loss = lambda lp, b: grpo.grpo_loss(lp, b, clip_epsilon=0.2, kl_coef=0.1)  # noqa: E731

    # At the sampler's log-probs: ratio 1, the loss is minus the token-mean advantage, nothing clipped.
    value, stats = loss(jnp.asarray(sampled), batch(sampled, advantages, mask))
    assert float(value) == pytest.approx(-(2 * 2 - 1 * 3) / 5)
    assert float(stats["clip_fraction"]) == 0 and float(stats["log_ratio_max"]) == 0

    # Off the mask anything goes (the sampler writes 0 there): no overflow into the loss.
    moved = sampled.copy()
    moved[0, 2] = -1e4
    moved[0, 0] += 0.5  # ratio e^0.5 > 1.2 with a positive advantage: clipped, no gradient
    moved[1, 0] += 0.5  # the same ratio with a negative advantage: not clipped
    value, stats = loss(jnp.asarray(moved), batch(sampled, advantages, mask))
    assert np.isfinite(float(value)) and float(stats["clip_fraction"]) == pytest.approx(1 / 5)
    assert float(stats["log_ratio_max"]) == pytest.approx(0.5)
    grad = jax.grad(lambda lp: loss(lp, batch(sampled, advantages, mask))[0])(jnp.asarray(moved))
    assert float(grad[0, 0]) == 0 and float(grad[0, 2]) == 0
    assert float(grad[0, 1]) == pytest.approx(-2 / 5) and float(grad[1, 0]) == pytest.approx(np.exp(0.5) / 5)

    # The KL term: zero at the reference, k3's exp(d) - d - 1 per token otherwise.
    _, stats = loss(jnp.asarray(sampled), batch(sampled, advantages, mask, reference=sampled))
    assert float(stats["kl"]) == 0
    reference = sampled - 0.3
    _, stats = loss(jnp.asarray(sampled), batch(sampled, advantages, mask, reference=reference))
    assert float(stats["kl"]) == pytest.approx(np.exp(-0.3) + 0.3 - 1, rel=1e-5)


def test_target_logprobs_in_blocks_equal_the_full_log_softmax(monkeypatch):
    monkeypatch.setattr(grpo, "LOGIT_BLOCK", 4)  # 10 positions: two full blocks and a padded one
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(3, 10, 8)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(8, 50)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 50, (3, 10)), jnp.int32)
    want = _full(hidden, kernel, targets)
    np.testing.assert_allclose(grpo.target_logprobs(hidden, kernel, targets), want, rtol=1e-6, atol=1e-6)
    grads = [jax.grad(lambda k, f=f: f(hidden, k, targets).sum())(kernel) for f in (grpo.target_logprobs, _full)]
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-5)


def _full(hidden, kernel, targets):
    return jnp.take_along_axis(jax.nn.log_softmax(hidden @ kernel), targets[..., None], axis=-1)[..., 0]
