"""Generation on the Qwen3-MoE model: greedy tokens and log-probs against transformers' `generate`, incremental
decoding against the full forward, log-probs against the training forward, the sampling filters' distributions,
bucketing, meshes, and the argument checks; the command line, examples/generate_qwen3_moe.py, run as users run it
(a subprocess on CPU)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from generation_cases import PROMPT_LENGTHS, generated_and_trained_logprobs, prompts_of
from hf_models import HF_CONFIG, tiny_hf_model
from job_cli import assert_usage_error, help_entries
from moe_cases import seeded_rng
from scipy import stats

from jax_megamoe.models import generation, qwen3_moe

transformers = pytest.importorskip("transformers")


def hf_greedy(model, prompts, max_new_tokens, eos_token_id):
    """transformers' greedy generate on left-padded prompts: `(tokens [B, n], logits [n, B, V])`."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[:, width:].numpy(), torch.stack(out.logits).numpy()


@pytest.fixture(scope="module")
def transformers_greedy(hf_checkpoint):
    """transformers' greedy run of 32 tokens from four prompts, with an eos token that row 0 emits midway (so
    rows stop at different steps): `(prompts, eos, tokens, logits)`."""
    hf, _ = hf_checkpoint
    prompts = prompts_of(PROMPT_LENGTHS)
    eos = int(hf_greedy(hf, prompts, 32, eos_token_id=None)[0][0, 12])
    return prompts, eos, *hf_greedy(hf, prompts, 32, eos_token_id=eos)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_greedy_matches_transformers(hf_checkpoint, transformers_greedy, scan_layers):
    ours = qwen3_moe.from_pretrained(hf_checkpoint[1], implementation="cpu", scan_layers=scan_layers)
    prompts, eos, want, hf_logits = transformers_greedy
    got = qwen3_moe.generate(ours, prompts, max_new_tokens=32, temperature=0, eos_token_id=eos)
    tokens, logprobs, lengths = map(np.asarray, (got.tokens, got.logprobs, got.lengths))
    assert got.routing is None  # recorded only when asked for
    assert tokens.shape == (4, 32) and tokens.dtype == np.int32 and logprobs.dtype == np.float32
    steps = want.shape[1]  # transformers stops once every row has
    np.testing.assert_array_equal(tokens[:, :steps], want)
    assert np.all(tokens[:, steps:] == 0)
    stops = [list(row).index(eos) + 1 if eos in row else 32 for row in want]
    np.testing.assert_array_equal(lengths, stops)
    assert min(stops) < 32
    want_logprobs = jax.nn.log_softmax(hf_logits, axis=-1)
    for row, length in enumerate(stops):
        expected = [want_logprobs[t, row, tokens[row, t]] for t in range(length)]
        np.testing.assert_allclose(logprobs[row, :length], expected, atol=1e-4)
        assert np.all(logprobs[row, length:] == 0)


@pytest.mark.parametrize(
    "scan_layers, attention_impl", [(True, None), (False, "chunked")], ids=["scanned-xla", "unrolled-chunked"]
)
def test_incremental_decoding_matches_the_full_forward(scan_layers, attention_impl):
    config = qwen3_moe.Qwen3MoeConfig.from_dict(HF_CONFIG)
    model = qwen3_moe.Qwen3MoeForCausalLM(
        config, implementation="cpu", scan_layers=scan_layers, attention_impl=attention_impl, rngs=nnx.Rngs(0)
    )
    ids = jnp.asarray(seeded_rng("decode ids").integers(0, config.vocab_size, (3, 14)))
    full, _ = nnx.jit(lambda m, ids: m(ids))(model, ids)
    lengths = jnp.array([4, 9, 6])
    prompt = jnp.where(jnp.arange(9) < lengths[:, None], ids[:, :9], 0)  # right-padded to the longest

    @nnx.jit
    def prefill(model, prompt, lengths, cache):
        hidden, cache = model.prefill(prompt, lengths, cache)
        return model.logits(hidden), cache

    @nnx.jit
    def decode(model, tokens, cache):
        hidden, cache = model.decode(tokens, cache)
        return model.logits(hidden[:, 0]), cache

    logits, cache = prefill(model, prompt, lengths, model.init_cache(3, 16))
    rows = jnp.arange(3)
    np.testing.assert_allclose(logits[rows, lengths - 1], full[rows, lengths - 1], atol=1e-5)
    for step in range(5):
        logits, cache = decode(model, ids[rows, lengths + step][:, None], cache)
        np.testing.assert_array_equal(cache.lengths, lengths + step + 1)
        np.testing.assert_allclose(logits, full[rows, lengths + step], atol=1e-5)


@pytest.mark.parametrize(
    "dtype, recipe, atol",
    # In bfloat16 decoding a token rounds differently from the forward over the whole sequence (other shapes,
    # other reduction orders), so the log-probs part slightly.
    [(jnp.float32, None, 1e-5), (jnp.bfloat16, None, 5e-2), (jnp.bfloat16, "fp8_blockwise", 5e-2)],
    ids=["float32", "bfloat16", "fp8_blockwise"],
)
def test_logprobs_match_the_training_forward(dtype, recipe, atol):
    config = qwen3_moe.Qwen3MoeConfig.from_dict(HF_CONFIG)
    model = qwen3_moe.Qwen3MoeForCausalLM(config, dtype=dtype, implementation="cpu", recipe=recipe, rngs=nnx.Rngs(1))
    generated, trained = generated_and_trained_logprobs(
        model, prompts_of(PROMPT_LENGTHS, seed=1), 12, temperature=1.3, top_k=20, key=jax.random.key(0)
    )
    np.testing.assert_allclose(generated, trained, atol=atol)


SAMPLING = [
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.5, top_k=6, top_p=0.9),
]
SAMPLING_IDS = ["temperature", "top_k", "top_p", "all"]


def transformers_processed(logits, temperature, top_k=None, top_p=None):
    from transformers.generation import logits_process as lp

    warpers = [lp.TemperatureLogitsWarper(temperature)]
    warpers += [lp.TopKLogitsWarper(top_k)] if top_k is not None else []
    warpers += [lp.TopPLogitsWarper(top_p)] if top_p is not None else []
    scores = torch.tensor(np.asarray(logits))
    for warper in warpers:
        scores = warper(None, scores)
    return scores.numpy()


@pytest.mark.parametrize("settings", SAMPLING, ids=SAMPLING_IDS)
def test_process_logits_is_transformers_pipeline(settings):
    logits = seeded_rng("process logits").normal(0, 2, (16, 12)).astype(np.float32)
    logits[0, :4] = logits[0, 4]  # a tie at the top-k boundary: kept, as transformers keeps it
    got = np.asarray(qwen3_moe.process_logits(jnp.asarray(logits), **settings))
    want = transformers_processed(logits, **settings)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-6)
    assert np.all(np.isfinite(got).sum(-1) >= 1)


def test_top_k_keeps_the_ties_of_its_last_token():
    processed = qwen3_moe.process_logits(jnp.array([3.0, 2.0, 1.0, 2.0, 2.0]), top_k=2)
    np.testing.assert_array_equal(np.isfinite(processed), [True, True, False, True, True])


@pytest.mark.parametrize("settings", SAMPLING, ids=SAMPLING_IDS)
def test_samples_follow_the_processed_distribution(settings):
    draws = 100_000
    logits = jnp.asarray(seeded_rng("sampled logits").normal(0, 1.5, 12), jnp.float32)
    keys = jax.random.split(jax.random.key(7), draws)
    tokens = jax.jit(jax.vmap(lambda key: qwen3_moe.sample_logits(key, logits, **settings)))(keys)
    counts = np.bincount(np.asarray(tokens), minlength=12)
    probs = np.asarray(jax.nn.softmax(qwen3_moe.process_logits(logits, **settings)), np.float64)
    support = probs > 0
    assert counts[~support].sum() == 0
    if "top_k" in settings or "top_p" in settings:
        assert 1 < support.sum() < 12  # the filters have something to filter
    expected = draws * probs[support] / probs[support].sum()
    assert stats.chisquare(counts[support], expected).pvalue > 1e-3


def test_greedy_is_the_first_most_likely_token():
    logits = jnp.array([[0.5, 2.0, 2.0, -1.0], [3.0, 0.0, 3.0, 3.0]])
    np.testing.assert_array_equal(qwen3_moe.sample_logits(None, logits, temperature=0), [1, 0])


@pytest.mark.parametrize("scan_layers, attention_impl", [(True, None), (False, "chunked")], ids=["scanned", "unrolled"])
def test_padding_mask_gives_left_padded_rows_their_own_values_and_gradients(scan_layers, attention_impl):
    config = qwen3_moe.Qwen3MoeConfig.from_dict(HF_CONFIG)
    model = qwen3_moe.Qwen3MoeForCausalLM(
        config, implementation="cpu", scan_layers=scan_layers, attention_impl=attention_impl, rngs=nnx.Rngs(2)
    )
    ids = jnp.asarray(seeded_rng("mask ids").integers(0, config.vocab_size, (2, 10)))
    pads = jnp.array([0, 3])
    columns = jnp.arange(10)
    mask = columns >= pads[:, None]
    left_padded = jnp.where(mask, jnp.take_along_axis(ids, jnp.maximum(columns - pads[:, None], 0), 1), 0)
    positions = jnp.maximum(columns - pads[:, None], 0)

    def loss(model, padded):
        if padded:
            logits, _ = model(left_padded, positions, attention_mask=mask)
            rows = [logits[0], logits[1, 3:]]
        else:
            logits, _ = model(ids)
            rows = [logits[0], logits[1, :7]]
        return sum(jnp.sum(jnp.sin(r)) for r in rows), rows

    value_and_grad = nnx.jit(nnx.value_and_grad(loss, has_aux=True), static_argnums=1)
    (want, want_rows), want_grad = value_and_grad(model, False)
    (got, got_rows), got_grad = value_and_grad(model, True)
    for g, w in zip(got_rows, want_rows, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)
    # Nothing reaches the loss from the padding (its keys are masked, its outputs unused): equal gradients, to
    # float32 rounding of each parameter's summed contributions.
    for got_leaf, want_leaf in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad), strict=True):
        np.testing.assert_allclose(got_leaf, want_leaf, atol=1e-5 * float(np.abs(want_leaf).max()))


@pytest.fixture(scope="module")
def tiny_model():
    return qwen3_moe.Qwen3MoeForCausalLM(
        qwen3_moe.Qwen3MoeConfig.from_dict(HF_CONFIG | {"max_position_embeddings": 40}),
        implementation="cpu",
        rngs=nnx.Rngs(3),
    )


def test_prompt_lengths_share_a_bucket_and_a_program(tiny_model):
    assert [generation.prompt_bucket(n) for n in (1, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64, 128]
    plan = qwen3_moe.generation_plan(tiny_model, 4, 11, 3)
    # [layers, B, slots, kv heads, head_dim] for k and v, float32
    assert plan == (16, 19, 2 * 3 * 4 * 19 * 2 * 8 * 4)
    before = qwen3_moe.compiled_programs()
    first = qwen3_moe.generate(tiny_model, prompts_of((5, 11, 3, 8)), max_new_tokens=3, temperature=0)
    qwen3_moe.generate(tiny_model, prompts_of((16, 1, 2, 9), seed=1), max_new_tokens=3, temperature=0)
    assert qwen3_moe.compiled_programs() == before + 1
    qwen3_moe.generate(tiny_model, prompts_of((17, 1, 2, 9)), max_new_tokens=3, temperature=0)
    assert qwen3_moe.compiled_programs() == before + 2
    # A right-padded array with its lengths is the same call as the list.
    prompts = prompts_of((5, 11, 3, 8))
    array = np.full((4, 12), 7, np.int32)
    for row, prompt in enumerate(prompts):
        array[row, : len(prompt)] = prompt
    again = qwen3_moe.generate(tiny_model, array, prompt_lengths=[5, 11, 3, 8], max_new_tokens=3, temperature=0)
    for got, want in zip(again, first, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(prompts=[[1, 2], []]), ValueError, "prompt 1 is empty"),
        (dict(prompts=np.ones((2, 4), np.int32), prompt_lengths=[4, 0]), ValueError, "prompt 1 is empty"),
        (dict(prompts=[[1] * 30], max_new_tokens=11), ValueError, "max_position_embeddings=40"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens must be an int >= 1"),
        (dict(top_p=0.0), ValueError, r"top_p must be None or a float in \(0, 1\]"),
        (dict(top_p=1.5), ValueError, r"top_p must be None or a float in \(0, 1\]"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(temperature=0.8), ValueError, "needs key="),
        (dict(prompts=[[1, 64]]), ValueError, "token id 64"),
        (dict(eos_token_id=[3, 99]), ValueError, "eos_token_id"),
        (dict(prompts=np.ones((2, 4), np.int32), prompt_lengths=[4]), ValueError, "prompt_lengths"),
    ],
)
def test_bad_arguments_are_clear_errors(tiny_model, kwargs, error, match):
    kwargs = dict(prompts=[[1, 2, 3]], max_new_tokens=4, temperature=0) | kwargs
    with pytest.raises(error, match=match):
        qwen3_moe.generate(tiny_model, **kwargs)


@pytest.fixture(scope="module")
def eight_expert_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf8")
    tiny_hf_model(seed=5, num_experts=8).save_pretrained(path)
    prompts = prompts_of((5, 11, 3, 8, 9, 2, 7, 4), seed=2)
    settings = dict(max_new_tokens=6, temperature=1.0, top_p=0.9, key=jax.random.key(3))
    single = qwen3_moe.generate(qwen3_moe.from_pretrained(path, implementation="cpu"), prompts, **settings)
    return path, prompts, settings, single


@pytest.mark.parametrize("shape", [(1, 8), (2, 4)], ids=["1x8", "2x4"])
def test_generate_on_a_mesh_matches_one_device(eight_expert_checkpoint, shape, monkeypatch):
    path, prompts, settings, want = eight_expert_checkpoint
    mesh = jax.make_mesh(shape, ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model = qwen3_moe.from_pretrained(path, implementation="cpu", mesh=mesh, fsdp=True)
    q_proj = model.layer_runs[0].self_attn.q_proj.kernel[...]
    assert ("data" in q_proj.sharding.spec) == (shape[0] > 1)  # FSDP where the data axis has devices
    compiled = []
    run = generation._run_jit

    def compile_and_run(*args):
        compiled.append(run.lower(*args).compile().as_text())
        return run(*args)

    monkeypatch.setattr(generation, "_run_jit", compile_and_run)
    with jax.set_mesh(mesh):
        got = qwen3_moe.generate(model, prompts, **settings)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    # No weight is gathered inside a loop (the decode loop, the scans over layers): the parameters are put into
    # their compute sharding once, before. What the loops gather is the router logits, for their top-k.
    gathers = re.findall(r"= \S+ all-gather\(.*?op_name=\"([^\"]*)\"", compiled[0])
    assert gathers and all("while" not in name or name.endswith("/top_k") for name in gathers), gathers
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="divisible by 8"):
        qwen3_moe.generate(model, prompts[:4], **settings)


SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "generate_qwen3_moe.py"
PROG = SCRIPT.name


def generate_cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Directories of one random tiny byte-level model (float32): `bytes` as the training job saves it (text as
    UTF-8 bytes), `tokenizer` with a byte-level BPE tokenizer.json whose ids are not the bytes'."""
    tokenizers = pytest.importorskip("tokenizers")
    model = qwen3_moe.Qwen3MoeForCausalLM(qwen3_moe.tiny(), implementation="cpu", rngs=nnx.Rngs(7))
    dirs = {name: tmp_path_factory.mktemp(name) for name in ("bytes", "tokenizer")}
    for path in dirs.values():
        qwen3_moe.save_pretrained(model, path)
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.save(str(dirs["tokenizer"] / "tokenizer.json"))
    return dirs


@pytest.mark.parametrize("vocabulary", ["bytes", "tokenizer"])
def test_command_line_prompts_reach_the_tokenizer_as_typed(model_dirs, vocabulary):
    """No escapes are decoded: a non-ASCII letter and a backslash come back as typed."""
    prompts = ["héllo", "a\\x", "tab\\t"]
    result = generate_cli(
        str(model_dirs[vocabulary]), *(f"--prompt={p}" for p in prompts), "--temperature", "0", "--max-new-tokens", "2"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for index, prompt in enumerate(prompts):
        assert f"--- sample {index}: {prompt!r} ->" in result.stdout, result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        ([b"--prompt", b"caf\xe9"], "--prompt 'caf\\udce9' is not UTF-8 text"),  # Latin-1 bytes
        (["--max-new-tokens", "0"], "error: --max-new-tokens must be an int >= 1, got 0"),
        (["--max-new-tokens", "5000"], "plus --max-new-tokens=5000 exceeds the model's max_position_embeddings=2048"),
        (["--temperature", "-1"], "error: --temperature must be a finite float >= 0 (0: greedy), got -1.0"),
        (["--top-k", "0"], "error: --top-k (the sampling filter) must be None or an int >= 1, got 0"),
        (["--top-p", "1.5"], "error: --top-p must be None or a float in (0, 1], got 1.5"),
        (["--eos", "7", "--eos", "999"], "error: --eos [999] outside [0, vocab_size=256)"),
    ],
)
def test_command_line_usage_errors_name_the_flag(model_dirs, args, message):
    error = assert_usage_error(generate_cli(str(model_dirs["bytes"]), *args), PROG, message)
    assert not re.search("max_new_tokens|temperature=|top_k|top_p|eos_token_id", error), error


def test_command_line_stops_at_the_model_dirs_eos_token_unless_told_otherwise(model_dirs, tmp_path):
    """The directory's generation_config.json names two eos ids, one of them the third greedy token: sampling stops
    there by default; `--eos` replaces the directory's ids."""
    model = qwen3_moe.from_pretrained(model_dirs["bytes"], implementation="cpu")
    tokens = np.asarray(qwen3_moe.generate(model, [list(b"def ")], max_new_tokens=8, temperature=0).tokens[0])
    eos, unused = int(tokens[2]), next(t for t in range(256) if t not in tokens)
    shutil.copytree(model_dirs["bytes"], tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [unused, eos]}))
    greedy = [str(tmp_path), "--prompt", "def ", "--temperature", "0", "--max-new-tokens", "8"]
    for extra, generated in (([], list(tokens).index(eos) + 1), (["--eos", str(unused)], 8)):
        result = generate_cli(*greedy, *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.strip().splitlines()[-1].startswith(f"{generated} tokens in "), result.stdout


def test_command_line_help_states_the_defaults():
    entries = help_entries(generate_cli("--help").stdout)
    assert all(entries.values()) and entries["--dtype"].endswith("(default: float32)"), entries
    assert "default: the eos_token_id of MODEL_DIR's generation_config.json" in entries["--eos"]


def test_command_line_model_dir_without_weights_is_a_usage_error(model_dirs, tmp_path):
    (tmp_path / "config.json").write_text((model_dirs["bytes"] / "config.json").read_text())
    message = f"MODEL_DIR: no weights (model.safetensors or model.safetensors.index.json) in {tmp_path}: pass"
    assert_usage_error(generate_cli(str(tmp_path)), PROG, message)
