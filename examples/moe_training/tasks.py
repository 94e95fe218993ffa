"""Verifiable tasks for RL post-training: problems drawn at random, each with an answer a program checks.

A task is two functions: `draw(rng) -> Problem` and `reward(problem, completion, stopped) -> float`. Any task
with a checkable answer plugs in as such a pair (`Task`). The held-out problems are a fixed share of the problem
space, chosen by a hash of the prompt, so a problem the policy is evaluated on never appears in training.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable

import numpy as np

HELD_OUT_EVERY = 8  # one prompt in this many (by hash) is held out


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str  # what the reward checks; the supervised warm-up trains on `answer` followed by the end token


@dataclasses.dataclass(frozen=True)
class Task:
    """`draw(rng)`: a random problem. `reward(problem, completion, stopped)`: the score of `completion` (the decoded
    text before the end token), `stopped` saying whether the end token came within the sampling budget.
    `prompt_chars`, `answer_chars`: the longest prompt and answer in characters (a byte-level model's tokens;
    None: no bound). `accuracy_threshold`: the reward at or above which a held-out answer counts as correct.
    `demonstrations`: whether `problem.answer` is a correct completion (what the supervised warm-up needs)."""

    name: str
    draw: Callable[[np.random.Generator], Problem]
    reward: Callable[[Problem, str, bool], float]
    prompt_chars: int
    answer_chars: int | None
    demonstrations: bool = True
    accuracy_threshold: float = 1.0


def digits_in_place(problem: Problem, completion: str, stopped: bool) -> float:
    """The share of characters in place: those equal to the answer's at the same position, over the longer of the
    two; 1 exactly for the answer itself. 0 for a completion without the end token."""
    if not stopped:
        return 0.0
    matches = sum(a == b for a, b in zip(problem.answer, completion, strict=False))
    return matches / max(len(problem.answer), len(completion), 1)


def reverse_digits(max_digits: int) -> Task:
    """`"1234="` -> `"4321"`: reverse a string of 1 to `max_digits` digits, drawn uniformly from all of them."""
    counts = 10 ** np.arange(1, max_digits + 1)

    def draw(rng):
        length = 1 + int(rng.choice(max_digits, p=counts / counts.sum()))
        digits = "".join(map(str, rng.integers(0, 10, length)))
        return Problem(f"{digits}=", digits[::-1])

    return Task("reverse", draw, digits_in_place, max_digits + 1, max_digits)


def add_numbers(max_digits: int) -> Task:
    """`"47+385="` -> `"432"`: add two numbers below `10**max_digits`, drawn uniformly."""

    def draw(rng):
        a, b = (int(n) for n in rng.integers(0, 10**max_digits, 2))
        return Problem(f"{a}+{b}=", str(a + b))

    return Task("add", draw, digits_in_place, 2 * max_digits + 2, max_digits + 1)


def digit_share(prompt_len: int) -> Task:
    """A synthetic task for any model and vocabulary: the prompt is 1 to `prompt_len` random letters, the reward
    the share of digits among the completion's characters (0 for an empty one). Nothing to demonstrate; learnable
    from a random start."""
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))

    def draw(rng):
        return Problem("".join(rng.choice(letters, int(rng.integers(1, prompt_len + 1)))), "")

    def reward(problem, completion, stopped):
        return sum(c.isdigit() for c in completion) / len(completion) if completion else 0.0

    return Task("synthetic", draw, reward, prompt_len, None, demonstrations=False, accuracy_threshold=0.5)


TASKS = {"reverse": reverse_digits, "add": add_numbers, "synthetic": digit_share}


def held_out(problem: Problem) -> bool:
    return zlib.crc32(problem.prompt.encode()) % HELD_OUT_EVERY == 0


def draw_problems(task: Task, rng: np.random.Generator, count: int, *, evaluation: bool = False) -> list[Problem]:
    """`count` problems from the training share of the problem space, or `count` distinct ones from the held-out
    share."""
    problems: list[Problem] = []
    for _ in range(1000 * count):
        problem = task.draw(rng)
        if held_out(problem) != evaluation or (evaluation and problem in problems):
            continue
        problems.append(problem)
        if len(problems) == count:
            return problems
    raise ValueError(f"task {task.name}: its problem space is too small to draw {count} problems from it")
