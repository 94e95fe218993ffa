"""The RL job's task and the text side of GRPO's rollouts (`jax_megamoe.rl` holds the rest): the task the flags
choose, its prompts as the sampler's right-padded token ids, each completion's text for the task's reward, and the
supervised warm-up's sequences."""

from __future__ import annotations

import numpy as np

from jax_megamoe import cli, rl
from moe_training import tasks
from moe_training.tasks import Problem
from moe_training.tokenizer import Tokenizer


def make_task(args) -> tasks.Task:
    """The task `--task` names, with `--prompt-width` and `--max-new-tokens` filled in from it where not given."""
    task = {
        "reverse": lambda: tasks.reverse_digits(args.max_digits),
        "add": lambda: tasks.add_numbers(args.max_digits),
        "synthetic": lambda: tasks.digit_share(args.prompt_len),
    }[args.task]()
    if args.sft_steps and not task.demonstrations:
        raise cli.UsageError(f"--task {task.name} has no answers to warm up on: pass --sft-steps 0")
    args.prompt_width = args.prompt_width or task.prompt_chars
    if args.max_new_tokens is None:
        if task.answer_chars is None:
            raise cli.UsageError(f"--task {task.name} has no longest answer: pass --max-new-tokens")
        args.max_new_tokens = task.answer_chars + 1
    return task


def encode_prompts(
    problems: list[Problem], tokenizer: Tokenizer, width: int, repeat: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """`rl.pad_prompts` of the problems' prompts as `tokenizer` encodes them, each repeated `repeat` times in a row."""
    encoded = [tokenizer.encode(p.prompt) for p in problems]
    longest = max(map(len, encoded))
    if longest > width:
        raise cli.UsageError(f"a prompt of {longest} tokens exceeds --prompt-width {width}: pass {longest} or more")
    return rl.pad_prompts(encoded, width, repeat)


def completions(tokens: np.ndarray, lengths: np.ndarray, tokenizer: Tokenizer) -> list[tuple[str, bool]]:
    """Each row's `(text before the end token, whether the end token came)`."""
    return [(tokenizer.decode(ids), stopped) for ids, stopped in rl.completions(tokens, lengths, tokenizer.end_id)]


def demonstrations(problems: list[Problem], tokenizer: Tokenizer, width: int, new_tokens: int) -> rl.Rollouts:
    """The supervised warm-up's sequences: each prompt followed by its answer and the end token, the mask on the
    answer and the end token."""
    prompt_ids, prompt_lengths = encode_prompts(problems, tokenizer, width)
    answers = [tokenizer.encode(p.answer) + [tokenizer.end_id] for p in problems]
    longest = max(map(len, answers))
    if longest > new_tokens:
        raise cli.UsageError(
            f"an answer and its end token take {longest} tokens, past --max-new-tokens {new_tokens}: pass {longest}"
        )
    tokens, lengths = rl.pad_prompts(answers, new_tokens)
    return rl.pack(prompt_ids, prompt_lengths, tokens, lengths)
