"""The main job, examples/train_qwen3_moe.py, run as users run it (a subprocess on 8 host CPU devices):
loss falls, outputs are written, resuming from a checkpoint reproduces the uninterrupted run's losses
exactly, a command line that cannot run exits with status 2 and a failing run with 1, each after one line
saying what to change."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from job_cli import help_entries
from moe_cases import seeded_rng
from recipes import EXAMPLES, run_in_examples

SCRIPT = EXAMPLES / "train_qwen3_moe.py"
SMALL = ["--batch", "8", "--seq", "32", "--eval-every", "3", "--eval-batches", "1", "--corpus-bytes", "200000"]
USAGE = "usage: train_qwen3_moe.py [options]  (--help lists them)"
ERROR = "train_qwen3_moe.py: error: "


def run(*args, check=True):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *SMALL, *args], capture_output=True, text=True, env=env, timeout=600
    )
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def losses(out_dir):
    with open(out_dir / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def test_trains_and_resume_reproduces_the_loss(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    result = run("--steps", "6", "--out-dir", str(full))
    summary = json.loads((full / "summary.json").read_text())
    assert summary["mesh"] == {"data": 2, "expert": 4}
    assert summary["final_loss"] < summary["first_loss"]
    assert np.isfinite(summary["final_eval_loss"])
    assert (full / "loss_curve.png").stat().st_size > 0
    [command] = re.findall(
        rf"^model saved to {re.escape(str(full / 'model'))} \(sample from it: (.*)\)$", result.stdout, re.M
    )
    sample_saved_model(full / "model", shlex.split(command))

    ckpt = tmp_path / "ckpt"
    run("--steps", "3", "--lr-decay-steps", "6", "--ckpt-dir", str(ckpt), "--ckpt-every", "3", "--out-dir", str(part))
    run("--steps", "6", "--ckpt-dir", str(ckpt), "--resume", "--out-dir", str(part))
    assert losses(part) == losses(full)  # bitwise: same data, same state, deterministic kernels


def sample_saved_model(model_dir, printed):
    """The final model the job saved is read back by the command the job printed (examples/generate_qwen3_moe.py
    under the job's own Python, which runs from a shell whose `python` is another), which prints a continuation of
    each prompt and its throughput line."""
    script = SCRIPT.parent / "generate_qwen3_moe.py"
    assert [Path(file).resolve() for file in printed[1:]] == [script, model_dir.resolve()]
    venv = Path(sys.executable).parent
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and Path(p).resolve() != venv.resolve()]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PATH=os.pathsep.join(path))
    greedy = ["--prompt", "def ", "--prompt", "x", "--temperature", "0", "--max-new-tokens", "5"]
    result = subprocess.run([*printed, *greedy], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("--- sample") == 2 and "--- sample 0: 'def ' ->" in result.stdout
    assert "1 program(s) compiled" in result.stdout and "tokens/s" in result.stdout
    missing = subprocess.run(
        [sys.executable, str(script), str(model_dir / "absent")], capture_output=True, text=True, env=env, timeout=300
    )
    assert missing.returncode == 2 and missing.stderr.strip().splitlines()[-1].startswith(
        "generate_qwen3_moe.py: error: MODEL_DIR"
    ), missing.stderr
    command = [sys.executable, str(script), str(model_dir), *greedy]
    bad_eos = subprocess.run([*command, "--eos", "999"], capture_output=True, text=True, env=env, timeout=300)
    assert bad_eos.returncode == 2 and bad_eos.stderr.strip().splitlines()[-1].startswith(
        "generate_qwen3_moe.py: error: --eos [999] outside [0, vocab_size=256)"
    ), bad_eos.stderr


def read_metrics(out_dir):
    with open(out_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def first_step_losses(streams: list[np.ndarray], batch: int, seq: int, seed: int = 0) -> list[tuple[float, float]]:
    """`(lm_loss, load_balancing_loss)` of step 1 on each token stream, recomputed here independently of the
    example's code: the train split is the stream without its last 5% (at least seq + 1 tokens), batch 1 is
    `batch` windows of seq + 1 tokens at starts drawn by default_rng([seed, 1]), and the tiny model starts from
    nnx.Rngs(seed) (float32, one device, the reference experts)."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jax_megamoe.models import qwen3_moe

    def first_batch(tokens):
        held_out = max(int(len(tokens) * 0.05), seq + 1)
        train = tokens[:-held_out]
        starts = np.random.default_rng([seed, 1]).integers(0, len(train) - seq - 1, size=batch)
        return jnp.asarray(np.stack([train[s : s + seq + 1] for s in starts]).astype(np.int32))

    @nnx.jit
    def losses(model, windows):
        logits, aux = model(windows[:, :-1])
        lm = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), windows[:, 1:]).mean()
        return lm, aux.load_balancing_loss

    model = qwen3_moe.Qwen3MoeForCausalLM(
        qwen3_moe.tiny(), dtype=jnp.float32, param_dtype=jnp.float32, implementation="reference", rngs=nnx.Rngs(seed)
    )
    return [tuple(float(v) for v in losses(model, first_batch(tokens))) for tokens in streams]


def test_token_file_expert_only_mesh_and_remat_saving_the_moe(tmp_path):
    """A raw uint16 token file, on an expert-only mesh of 8, under remat saving the MoE residuals: the first
    step's losses are those of the file's first batch recomputed here (so the example read the file's tokens,
    split and windowed them as documented, and its expert-parallel, rematerialised model computes the plain
    model's loss), and the run's mesh is the one asked for."""
    tokens = seeded_rng("token file").integers(0, 200, 20000).astype(np.uint16)
    tokens.tofile(tmp_path / "tokens.bin")
    run(
        "--steps",
        "1",
        "--data",
        str(tmp_path / "tokens.bin"),
        "--mesh-expert",
        "8",
        "--dtype",
        "float32",
        "--remat",
        "--remat-save-moe",
        "--out-dir",
        str(tmp_path / "out"),
    )
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["mesh"] == {"data": 1, "expert": 8}
    [record] = read_metrics(tmp_path / "out")
    assert record["step"] == 1 and record["dropped_pairs"] == 0
    # Another stream gives another loss: the match below is not a property of the model alone.
    other_stream = seeded_rng("another stream").integers(0, 200, 20000).astype(np.uint16)
    (lm, balance), (other, _) = first_step_losses(
        [np.fromfile(tmp_path / "tokens.bin", np.uint16), other_stream], batch=8, seq=32
    )
    np.testing.assert_allclose(record["lm_loss"], lm, rtol=1e-5)
    np.testing.assert_allclose(record["load_balancing_loss"], balance, rtol=1e-5)
    aux_coef = summary["config"]["router_aux_loss_coef"]
    np.testing.assert_allclose(record["loss"], lm + aux_coef * balance, rtol=1e-5)
    assert summary["first_loss"] == record["lm_loss"]
    assert abs(other - lm) > 1e-4


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "/no/such/file.npy"], "no such file"),
        (["--mesh-expert", "3"], "must use all 8 devices"),
        (["--batch", "12"], "divisible by the 8 devices"),
        (["--resume"], "--resume needs --ckpt-dir"),
        (["--remat-save-moe"], "--remat-save-moe needs --remat"),
        (["--steps", "0"], "--steps must be >= 1"),
        # Numbers that only make sense positive, or not negative.
        (["--lr", "-1"], "--lr must be > 0, got -1.0"),
        (["--lr", "nan"], "--lr must be a finite number, got nan"),
        (["--grad-clip", "0"], "--grad-clip must be > 0, got 0.0"),
        (["--memory-budget-gb", "-5"], "--memory-budget-gb must be > 0, got -5.0"),
        (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
        (["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1"),
        (["--z-loss-coef", "-0.001"], "--z-loss-coef must be >= 0, got -0.001"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--transport", "nvlink"], "--transport nvlink"),  # no GPUs here: the nvlink transport cannot run
        (["--transport", "auto"], "invalid choice"),
        (["--implementation", "tpu"], "invalid choice"),
        (["--backend", "cpu"], "unrecognized arguments: --backend"),  # the old flags are gone
        (["--ep-backend", "xla"], "unrecognized arguments: --ep-backend"),
        (["--recipe", "fp8_blockwise", "--dtype", "float32"], "needs --dtype bfloat16"),
        (["--recipe", "fp8_blockwise", "--implementation", "ragged_dot"], "runs on moe_ffn's kernels"),
        (["--param-dtype", "float16"], "invalid choice"),
        # Flags this CPU-only machine cannot run end alike, whichever it is.
        (["--implementation", "cuda"], "--implementation cuda: implementation='cuda'"),
        (["--transport", "ragged"], "--transport ragged: transport='ragged' needs jax.lax.ragged_all_to_all"),
        (["--seq", "4096"], "--seq 4096 exceeds the model's max_position_embeddings 2048: pass --seq 2048 or less"),
    ],
)
def test_bad_flags_get_clear_errors(args, message):
    result = run(*args, check=False)
    assert_usage_error(result, message)


def test_help_explains_every_flag_and_states_each_default_once():
    entries = help_entries(run("--help").stdout)
    assert len(entries) > 40 and all(entries.values()), [flag for flag, text in entries.items() if not text]
    defaults = {"--z-loss-coef": "0.0", "--seed": "0", "--weight-decay": "0.1", "--dtype": "bfloat16"}
    for flag, default in defaults.items():
        assert entries[flag].endswith(f"(default: {default})"), entries[flag]
    assert entries["--memory-budget-gb"].count("(default:") == 1, entries["--memory-budget-gb"]


def assert_usage_error(result, message):
    """Exit status 2, and on stderr the short usage line and one error line holding `message`, nothing else."""
    assert result.returncode == 2, result.stderr[-3000:]
    usage, error = result.stderr.strip().splitlines()
    assert usage == USAGE
    assert error.startswith(ERROR) and message in error, error


def test_resuming_from_a_directory_that_does_not_exist_creates_nothing(tmp_path):
    result = run("--resume", "--ckpt-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path / "out"), check=False)
    assert_usage_error(result, f"--resume: --ckpt-dir {tmp_path / 'ckpt'} does not exist")
    assert not list(tmp_path.iterdir())


def test_resuming_with_other_model_flags_names_the_parameter_and_the_flag(tmp_path):
    """A checkpoint of the 2-layer tiny model refuses to resume a run whose flags build another state, naming the
    first differing parameter, both shapes (or dtypes) and the flag that builds the checkpoint's state; the
    one-step run that wrote it is too short to time, and says so."""
    ckpt = ["--ckpt-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path / "out")]
    first = run("--steps", "1", *ckpt)
    assert "; n/a tokens/s;" in first.stdout
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["tokens_per_s"] is None
    for flags, message in [
        (
            ["--layers", "3"],
            "layer_runs.0.input_layernorm.scale is stored (2, 64), this run asks for (3, 64): resume with --layers 2",
        ),
        (["--no-scan-layers"], "is stored (2, 64), this run asks for absent: resume with --scan-layers"),
        (
            ["--param-dtype", "bfloat16"],
            "embed_tokens.embedding is stored as float32, this run asks for bfloat16: resume with "
            "--param-dtype float32",
        ),
    ]:
        result = run("--steps", "2", "--resume", *flags, *ckpt, check=False)
        assert_usage_error(result, f"--resume: the checkpoint of step 1 in {tmp_path / 'ckpt'} does not fit this run")
        assert message in result.stderr
    assert_usage_error(run("--steps", "2", *ckpt, check=False), "already holds checkpoints up to step 1: pass --resume")


def test_a_failing_run_exits_with_status_1_after_one_line(tmp_path):
    """A run whose gradients become non-finite stops there, and one that cannot write its outputs stops when it
    tries: exit status 1 and one line, no traceback."""
    result = run("--steps", "2", "--warmup", "0", "--lr", "1e30", "--out-dir", str(tmp_path / "out"), check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert re.fullmatch(
        re.escape(ERROR) + r"at step 2 the loss is \S+ and the gradient norm (nan|inf): lower --lr \(now 1e\+30\) "
        r"or raise --warmup \(now 0\)",
        result.stderr.strip().splitlines()[-1],
    )

    (tmp_path / "a_file").write_text("")
    result = run("--steps", "1", "--out-dir", str(tmp_path / "a_file"), check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"{ERROR}[Errno 17] File exists: '{tmp_path / 'a_file'}'"


def test_bf16_parameters_and_the_fp8_recipe(tmp_path):
    """`--param-dtype bfloat16` stores parameters and AdamW's moments in bf16 (the dry run's plan: half the float32
    bytes); `--recipe fp8_blockwise` reaches every MoE layer: step 1's loss differs from the bf16 run's (the
    experts' GEMMs see quantised operands) by well under a percent, and both runs train."""
    plans = {}
    for dtype in ("float32", "bfloat16"):
        run("--param-dtype", dtype, "--dry-run", "--out-dir", str(tmp_path / f"plan_{dtype}"))
        plans[dtype] = json.loads((tmp_path / f"plan_{dtype}" / "memory_plan.json").read_text())
        assert plans[dtype]["param_dtype"] == dtype
    for part in ("params", "optimizer_state"):
        f32, bf16 = (plans[d]["per_device_bytes"][part] for d in ("float32", "bfloat16"))
        assert abs(bf16 / f32 - 0.5) < 0.01, (part, f32, bf16)

    runs = {}
    for name, extra in (("bf16", []), ("fp8", ["--recipe", "fp8_blockwise"])):
        out = tmp_path / name
        run("--steps", "3", "--param-dtype", "bfloat16", *extra, "--out-dir", str(out))
        summary = json.loads((out / "summary.json").read_text())
        assert summary["param_dtype"] == "bfloat16" and summary["recipe"] == (extra[1] if extra else None)
        runs[name] = read_metrics(out)
    for records in runs.values():
        assert all(np.isfinite(r["loss"]) for r in records)
    bf16, fp8 = (runs[n][0]["lm_loss"] for n in ("bf16", "fp8"))
    assert bf16 != fp8 and abs(fp8 - bf16) / bf16 < 1e-2, (bf16, fp8)


def test_jax_gpu_allocator_share_is_raised_unless_the_user_set_it():
    """JAX's allocator takes 75% of a GPU's memory by default, less than the memory plan's budget."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    run_in_examples(
        """
        import os
        from moe_training import flags

        os.environ["XLA_FLAGS"] = "--xla_dump_to=/dev/null"
        flags.configure_jax_environment(8)
        assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == flags.GPU_MEMORY_FRACTION
        assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/dev/null --xla_force_host_platform_device_count=8"
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.5"
        flags.configure_jax_environment(8)
        assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
        """,
        env=env,
    )
