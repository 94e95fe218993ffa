"""The RL job, examples/rl_qwen3_moe.py: run as users run it (a subprocess on 8 host CPU devices), GRPO raises a
learnable reward while the sampler's log-probs are the trainer's at the first update of every batch, and resuming
from a checkpoint reproduces the uninterrupted run; its recipes (tasks, the text side of the rollouts) on small
cases; bad flags get one-line errors. The library's part (`jax_megamoe.rl`) has its own tests: tests/test_rl.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from job_cli import assert_usage_error, help_entries
from recipes import EXAMPLES, run_in_examples

from jax_megamoe.models import qwen3_moe

SCRIPT = EXAMPLES / "rl_qwen3_moe.py"

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
        (["--behaviour", "trainer", "--temperature", "0.7"], "use --temperature 1 and no --top-k/--top-p"),
        (["--behaviour", "trainer", "--top-p", "0.9"], "use --temperature 1 and no --top-k/--top-p"),
        (["--mask-band", "0.5", "2"], "--mask-band masks by pi_trainer / pi_sampler: it needs --behaviour trainer"),
        (["--behaviour", "trainer", "--mask-band", "1.5", "2"], "0 <= LOW < 1 < HIGH"),
        (["--behaviour", "trainer", "--tis-cap", "0.5"], "--tis-cap must be >= 1"),
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


def test_routing_replay_and_truncated_importance_sampling_learn_and_measure_the_mismatch(tmp_path):
    """--routing-replay --behaviour trainer --mask-band: the reward rises; in float32 sampler and trainer agree,
    so no routing choice differs, no weight is truncated or masked, and the k3 KL is 0 to rounding; the extra
    forward is timed and the mismatch plotted."""
    out = tmp_path / "replay"
    replay = ["--routing-replay", "--behaviour", "trainer", "--mask-band", "0.5", "2", "--steps", "12"]
    run(*LEARNABLE[: LEARNABLE.index("--steps")], *LEARNABLE[LEARNABLE.index("--steps") + 2 :], *replay,
        "--out-dir", str(out))  # fmt: skip
    _, *steps = records(out)
    rewards = [r["reward"] for r in steps]
    assert np.mean(rewards[-4:]) > 2 * np.mean(rewards[:4]), rewards
    for r in steps:
        assert r["routing_mismatch"] == 0 and r["tis_truncated"] == 0 and r["band_masked"] == 0, r
        assert 0 <= r["sampler_kl"] <= 1e-9 and r["log_ratio_max"] <= 1e-5 and r["recompute_time_s"] > 0, r
    summary = json.loads((out / "summary.json").read_text())
    assert summary["routing_replay"] and summary["behaviour"] == "trainer" and summary["mask_band"] == [0.5, 2.0]
    assert summary["median_routing_mismatch_at_first_update"] == 0
    assert (out / "mismatch_curve.png").stat().st_size > 0


def test_resuming_from_a_directory_that_does_not_exist_creates_nothing(tmp_path):
    result = run("--resume", "--ckpt-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path / "out"), check=False)
    assert_usage_error(result, SCRIPT.name, f"--resume: --ckpt-dir {tmp_path / 'ckpt'} does not exist")
    assert not list(tmp_path.iterdir())


def test_init_without_weights_is_a_usage_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(qwen3_moe.tiny().to_dict()))
    error = "--init: no weights (model.safetensors or model.safetensors.index.json) in"
    assert_usage_error(run("--init", str(tmp_path), check=False), SCRIPT.name, error)


def test_tasks_hold_out_their_evaluation_problems_and_score_digits_in_place():
    run_in_examples(
        """
        import numpy as np
        from moe_training import tasks

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
        assert abs(score(problem, "324", True) - 2 / 3) < 1e-12
        assert abs(score(problem, "3210", True) - 3 / 4) < 1e-12
        assert score(problem, "", True) == 0.0
        """
    )


def test_prompts_completions_and_demonstrations_as_text():
    """The job's text side of the rollouts (moe_training/rollouts.py) over `jax_megamoe.rl`: prompts encoded and
    padded, completions decoded up to the end token, and the warm-up's answers packed behind their prompts."""
    run_in_examples(
        """
        import numpy as np
        from jax_megamoe import cli
        from moe_training import rollouts, tasks
        from moe_training.tokenizer import Tokenizer

        tokenizer = Tokenizer(None, 256)  # bytes, the end token a newline
        problems = [tasks.Problem("ab", ""), tasks.Problem("cde", "")]
        ids, lengths = rollouts.encode_prompts(problems, tokenizer, 4, repeat=2)
        assert ids.tolist() == [[97, 98, 0, 0]] * 2 + [[99, 100, 101, 0]] * 2 and lengths.tolist() == [2, 2, 3, 3]
        try:
            rollouts.encode_prompts([tasks.Problem("abcde", "")], tokenizer, 4)
            raise AssertionError("a prompt past --prompt-width")
        except cli.UsageError as error:
            assert "exceeds --prompt-width 4: pass 5 or more" in str(error)

        texts = rollouts.completions(np.array([[52, 50, 10, 0], [52, 50, 51, 53]]), np.array([3, 4]), tokenizer)
        assert texts == [("42", True), ("4235", False)]
        demos = rollouts.demonstrations([tasks.Problem("12=", "21")], tokenizer, width=3, new_tokens=4)
        assert demos.tokens[0].tolist() == [ord(x) for x in "12=21\\n"] + [0]
        assert demos.mask[0].tolist() == [0, 0, 1, 1, 1, 0]
        """
    )
