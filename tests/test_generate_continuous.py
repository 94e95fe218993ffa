"""Continuous batching: `generate(..., rows=R)` with more prompts than rows, per-prompt budgets and per-prompt
sampling keys. Each prompt's results are those of generating it alone."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from generation_cases import prompts_of
from hf_models import HF_CONFIG

from jax_megamoe.models import qwen3_moe

LENGTHS = (5, 11, 3, 8, 2, 9, 6)
BUDGETS = [9, 2, 1, 5, 7, 3, 4]  # long-tailed: a row that gets the short ones takes more prompts


@pytest.fixture(scope="module")
def model():
    config = qwen3_moe.Qwen3MoeConfig.from_dict(HF_CONFIG)
    return qwen3_moe.Qwen3MoeForCausalLM(config, implementation="cpu", rngs=nnx.Rngs(1))


def alone(model, prompt, budget, **settings):
    """`generate` of one prompt by itself, its results as numpy."""
    out = qwen3_moe.generate(model, [prompt], max_new_tokens=budget, return_routing=True, **settings)
    return jax.tree.map(lambda a: np.asarray(a)[0], out)


def assert_prompt_results(out, row, want, budget, width):
    n = int(want.lengths)
    assert int(out.lengths[row]) == n <= budget
    np.testing.assert_array_equal(np.asarray(out.tokens[row, :n]), want.tokens[:n])
    assert np.all(np.asarray(out.tokens[row, n:]) == 0)  # the pad token after the prompt ends
    np.testing.assert_allclose(np.asarray(out.logprobs[row, :n]), want.logprobs[:n], atol=1e-5)
    assert np.all(np.asarray(out.logprobs[row, n:]) == 0)
    # The routing record: the prompt's bucket and width differ alone, the fed positions do not.
    fed = np.flatnonzero(want.routing[:, 0, 0] >= 0)
    record = np.asarray(out.routing[row])
    np.testing.assert_array_equal(record[fed], want.routing[fed])
    assert np.all(record[fed.max() + 1 :] == -1)


@pytest.fixture(scope="module")
def greedy_alone(model):
    prompts = prompts_of(LENGTHS, seed=4)
    return prompts, [alone(model, p, b, temperature=0) for p, b in zip(prompts, BUDGETS, strict=True)]


@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_prompts_get_the_results_of_generating_them_alone(model, greedy_alone, rows):
    prompts, want = greedy_alone
    out = qwen3_moe.generate(model, prompts, max_new_tokens=BUDGETS, temperature=0, rows=rows, return_routing=True)
    assert out.tokens.shape == (len(prompts), max(BUDGETS))
    for row, budget in enumerate(BUDGETS):
        assert_prompt_results(out, row, want[row], budget, max(BUDGETS))


def test_an_eos_token_ends_a_prompt_and_frees_its_row(model):
    prompts = prompts_of(LENGTHS, seed=5)
    probe = qwen3_moe.generate(model, prompts, max_new_tokens=8, temperature=0)
    eos = int(probe.tokens[0, 2])  # prompt 0 emits it third
    out = qwen3_moe.generate(model, prompts, max_new_tokens=8, temperature=0, eos_token_id=eos, rows=2,
                             return_routing=True)  # fmt: skip
    assert int(out.lengths[0]) == 3
    for row in (0, 1, 5):  # the one that stops early, and two that take its row after it
        assert_prompt_results(out, row, alone(model, prompts[row], 8, temperature=0, eos_token_id=eos), 8, 8)


def test_sampled_prompts_do_not_depend_on_the_row_that_served_them(model):
    prompts = prompts_of(LENGTHS, seed=6)
    keys = jax.random.split(jax.random.key(7), len(prompts))
    settings = dict(temperature=1.0, top_p=0.95)
    static = qwen3_moe.generate(model, prompts, max_new_tokens=BUDGETS, key=keys, **settings)
    for rows in (2, 3):
        out = qwen3_moe.generate(model, prompts, max_new_tokens=BUDGETS, key=keys, rows=rows, **settings)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(static.tokens))
        np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(static.logprobs), atol=1e-5)
    for row in (0, 4):  # alone, with its own key, a prompt draws the same tokens
        want = alone(model, prompts[row], BUDGETS[row], key=keys[row][None], **settings)
        np.testing.assert_array_equal(np.asarray(static.tokens[row, : BUDGETS[row]]), want.tokens)
    # One key: prompt i takes fold_in(key, i).
    one = qwen3_moe.generate(model, prompts, max_new_tokens=BUDGETS, key=jax.random.key(7), rows=2, **settings)
    folded = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(7), i))(np.arange(len(prompts)))
    want = qwen3_moe.generate(model, prompts, max_new_tokens=BUDGETS, key=folded, **settings)
    np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(want.tokens))


def test_the_cache_has_the_rows_and_the_programs_stay_few(model, monkeypatch):
    batches = []
    init_cache = qwen3_moe.Qwen3MoeForCausalLM.init_cache

    def recorded(self, batch, length, **kwargs):
        batches.append(batch)
        return init_cache(self, batch, length, **kwargs)

    monkeypatch.setattr(qwen3_moe.Qwen3MoeForCausalLM, "init_cache", recorded)
    before = qwen3_moe.compiled_programs()
    for count in (5, 6, 7, 8):  # the prompts are padded to 8: one program
        out = qwen3_moe.generate(model, prompts_of(LENGTHS + (4,), seed=8)[:count], max_new_tokens=3, temperature=0,
                                 rows=2)  # fmt: skip
        assert out.tokens.shape == (count, 3)
    assert qwen3_moe.compiled_programs() == before + 1
    assert batches == [2]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(rows=0), ValueError, "rows must be an int >= 1"),
        (dict(max_new_tokens=[3, 4]), ValueError, "2 budgets for 3 prompts"),
        (dict(max_new_tokens=[3, 0, 2]), ValueError, "max_new_tokens must be one int >= 1 per prompt"),
        (dict(temperature=1.0, key=jax.random.split(jax.random.key(0), 2)), ValueError, r"\(2,\) keys for 3"),
        (dict(temperature=1.0, key=np.zeros(2)), TypeError, "key must be a jax.random.key"),
    ],
)
def test_bad_arguments_are_clear_errors(model, kwargs, error, match):
    kwargs = dict(prompts=prompts_of((3, 4, 5)), max_new_tokens=4, temperature=0) | kwargs
    with pytest.raises(error, match=match):
        qwen3_moe.generate(model, **kwargs)
