"""GRPO's host side: prompts as the sampler's right-padded arrays, each sampled completion packed behind its prompt
into a training sequence, rewards from the task, and advantages normalised within each prompt's group.

A training sequence is `prompt + completion + padding`, so each token keeps the position it had when it was
sampled (the sampler's rows start at position 0 whatever their prompt's length) and padding only trails the
real tokens: the causal mask alone keeps it out of every real token's attention. The loss mask and the
sampler's log-probs are aligned with the targets, `sequence[:, 1:]`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from moe_training import cli
from moe_training.tasks import Problem, Task


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Rollouts:
    """`tokens [R, S]` int32 training sequences; `mask [R, S-1]` 1 at the completion's targets;
    `sampler_logprobs [R, S-1]` the sampler's log-prob of each target (0 off the mask); `advantages [R]`;
    `reference_logprobs [R, S-1]` the KL reference's, where the loss has a KL term."""

    tokens: np.ndarray
    mask: np.ndarray
    sampler_logprobs: np.ndarray
    advantages: np.ndarray
    reference_logprobs: np.ndarray | None = None

    def rows(self, index) -> Rollouts:
        return jax.tree.map(lambda x: x[index], self)


def encode_prompts(problems: list[Problem], text, width: int, repeat: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """`(ids [len(problems) * repeat, width] int32 right-padded with 0, lengths [...] int32)`, each prompt repeated
    `repeat` times in a row (a group of samples per prompt)."""
    encoded = [text.encode(p.prompt) for p in problems]
    longest = max(map(len, encoded))
    if longest > width:
        raise cli.UsageError(f"a prompt of {longest} tokens exceeds --prompt-width {width}: pass {longest} or more")
    ids = np.zeros((len(encoded), width), np.int32)
    for row, prompt in enumerate(encoded):
        ids[row, : len(prompt)] = prompt
    lengths = np.array(list(map(len, encoded)), np.int32)
    return np.repeat(ids, repeat, axis=0), np.repeat(lengths, repeat)


def pack(
    prompt_ids: np.ndarray,
    prompt_lengths: np.ndarray,
    tokens: np.ndarray,
    lengths: np.ndarray,
    logprobs: np.ndarray | None = None,
    advantages: np.ndarray | None = None,
) -> Rollouts:
    """Completions `tokens [R, N]` (the first `lengths` of each row are real) behind their prompts
    (`prompt_ids [R, P]`, the first `prompt_lengths` real): sequences of `P + N` tokens, padded with 0."""
    rows, width = prompt_ids.shape
    seq = width + tokens.shape[1]
    column = np.arange(seq)[None, :]
    start, end = prompt_lengths[:, None], (prompt_lengths + lengths)[:, None]
    completion = (column >= start) & (column < end)
    picked = np.clip(column - start, 0, tokens.shape[1] - 1)
    packed = np.where(column < start, np.pad(prompt_ids, ((0, 0), (0, seq - width))), 0)
    packed = np.where(completion, np.take_along_axis(tokens, picked, axis=1), packed).astype(np.int32)
    sampled = np.zeros((rows, seq), np.float32)
    if logprobs is not None:
        sampled = np.where(completion, np.take_along_axis(logprobs, picked, axis=1), 0).astype(np.float32)
    return Rollouts(
        packed,
        completion[:, 1:].astype(np.float32),
        sampled[:, 1:],
        np.zeros(rows, np.float32) if advantages is None else advantages.astype(np.float32),
    )


def completions(tokens: np.ndarray, lengths: np.ndarray, text) -> list[tuple[str, bool]]:
    """Each row's `(text before the end token, whether the end token came)`."""
    result = []
    for row, length in zip(tokens, lengths, strict=True):
        ids = row[:length]
        stopped = length > 0 and ids[-1] == text.end_id
        result.append((text.decode(ids[:-1] if stopped else ids), bool(stopped)))
    return result


def rewards(task: Task, problems: list[Problem], texts: list[tuple[str, bool]], group: int) -> np.ndarray:
    """`[len(problems), group]` rewards of the sampled completions (grouped as `encode_prompts` repeats)."""
    scores = [task.reward(problems[i // group], text, stopped) for i, (text, stopped) in enumerate(texts)]
    return np.array(scores, np.float32).reshape(len(problems), group)


def group_advantages(rewards: np.ndarray, epsilon: float = 1e-4) -> np.ndarray:
    """GRPO's advantages: each reward less its group's mean, over the group's standard deviation (`[P, G]` ->
    `[P * G]`); a group whose samples all score alike gets zeros."""
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    return (centred / (rewards.std(axis=1, keepdims=True) + epsilon)).reshape(-1)


def demonstrations(problems: list[Problem], text, width: int, new_tokens: int) -> Rollouts:
    """The supervised warm-up's sequences: each prompt followed by its answer and the end token, the mask on the
    answer and the end token."""
    prompt_ids, prompt_lengths = encode_prompts(problems, text, width)
    answers = [text.encode(p.answer) + [text.end_id] for p in problems]
    longest = max(map(len, answers))
    if longest > new_tokens:
        raise cli.UsageError(
            f"an answer and its end token take {longest} tokens, past --max-new-tokens {new_tokens}: pass {longest}"
        )
    tokens = np.zeros((len(answers), new_tokens), np.int32)
    for row, answer in enumerate(answers):
        tokens[row, : len(answer)] = answer
    return pack(prompt_ids, prompt_lengths, tokens, np.array(list(map(len, answers)), np.int32))
