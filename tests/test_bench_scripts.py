"""CPU smoke tests of the benchmark scripts' plumbing (their GPU numbers come from scripts/gpu_check.sh)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from benchmarks import ROOT, bench_ep
from benchmarks.moe_bench import children, impls, jax_impls, rates, report, shapes, torch_impls


def cpu_env(devices: int) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env.pop("NCCL_MAX_CTAS", None)
    return env


def run_script(name: str, *args: str, devices: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """benchmarks/`name` with `args` in a fresh process on `devices` host devices, run as the module
    `benchmarks.NAME` from the repository root; its output captured."""
    command = [sys.executable, "-m", f"benchmarks.{name.removesuffix('.py')}", *args]
    return subprocess.run(command, cwd=ROOT, env=cpu_env(devices), capture_output=True, text=True, timeout=timeout)


def test_nccl_concurrency_runs_moe_and_collectives_on_two_cpu_devices(tmp_path):
    out = tmp_path / "concurrency.json"
    proc = run_script(
        "nccl_concurrency.py",
        str(out),
        "--transport",
        "xla",
        "--iters",
        "3",
        "--collective-mib",
        "1",
        "--config",
        "tiny",
        "--nccl-max-ctas",
        "32",
        devices=2,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["devices"] == 2 and result["transport"] == "xla"
    assert result["iterations_done"] == 3 and result["hangs"] == 0
    assert result["checksum_mismatches"] == 0 and result["collectives_exact"] is True
    assert result["env"]["NCCL_MAX_CTAS"] == "32" and result["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert result["time_per_iteration_ms"]["median"] > 0


def test_nccl_concurrency_watchdog_aborts_a_stuck_iteration():
    # The watchdog alone (no JAX): an iteration armed and never disarmed must end the process with exit 3.
    code = (
        "import time\nfrom benchmarks import nccl_concurrency as n\n"
        "watchdog = n.Watchdog(0.2, lambda iteration, start: print('hung at', iteration, flush=True))\n"
        "watchdog.arm(7)\n"
        "time.sleep(30)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "hung at 7"


def test_bench_ep_transport_list():
    assert bench_ep.parse_transports("xla,ragged,nvlink") == ["xla", "ragged", "nvlink"]
    assert bench_ep.parse_transports(" xla , xla ") == ["xla"]
    for bad in ("", "xla,bogus", "nvlink_stage1", "auto"):
        with pytest.raises(argparse.ArgumentTypeError, match="comma list"):
            bench_ep.parse_transports(bad)


class _FakeWorkspace:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


def test_bench_ep_nvlink_opens_its_workspace_and_passes_the_transport(monkeypatch):
    # "nvlink" runs moe_ffn_ep with transport=NvlinkTransport(workspace), the workspace closed after the block.
    import jax_megamoe as jmm

    monkeypatch.setattr(jmm, "NvlinkTransport", lambda workspace: ("transport of", workspace))
    with bench_ep.ep_options("nvlink", _FakeWorkspace) as options:
        kind, workspace = options["transport"]
        assert kind == "transport of" and isinstance(workspace, _FakeWorkspace) and list(options) == ["transport"]
        assert not workspace.closed
    assert workspace.closed
    with bench_ep.ep_options("xla", _FakeWorkspace) as options:
        assert options == {"transport": "xla"}


def test_bench_moe_tiles_impl_names_give_an_explicit_gemm_config():
    from jax_megamoe import GemmConfig, GemmTiles

    shape = shapes.CONFIGS["q30"]
    t, h, i, e, k = shape
    heuristic = GemmConfig.for_problem(t, k, h, i, e)
    assert impls.gemm_config("ours", shape) is None
    for tiles in GemmTiles:
        config = impls.gemm_config(f"ours_tiles_{tiles.name.lower()}", shape)
        assert config == GemmConfig(tiles, tiles, tiles, tiles)
    last = list(GemmTiles)[-1]
    config = impls.gemm_config(f"ours_tiles_fwd_down={last.name.lower()}+bwd_gate_up={last.name}", shape)
    assert config == GemmConfig(heuristic.fwd_gate_up, last, heuristic.bwd_down, last)
    for bad, message in (
        ("ours_tiles_", "got nothing"),
        ("ours_tiles_bogus", "unknown tiles"),
        (f"ours_tiles_bwd_up={last.name}", "is not one of"),
        (f"ours_tiles_fwd_down={last.name}+fwd_down={last.name}", "each once"),
    ):
        with pytest.raises(ValueError, match=message):
            impls.gemm_config(bad, shape)


def test_bench_moe_graphs_impl_adds_the_command_buffer_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert children.child_env("ours_graphs")["XLA_FLAGS"] == "--xla_dump_to=/tmp/x " + impls.GRAPH_XLA_FLAGS
    assert children.child_env("ours")["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
    monkeypatch.delenv("XLA_FLAGS")
    assert children.child_env("ours_graphs")["XLA_FLAGS"] == impls.GRAPH_XLA_FLAGS


def test_bench_moe_table_fits_long_impl_names():
    row = dict(
        impl="ours_tiles_fwd_gate_up=coop_128x256+fwd_down=coop_128x256",
        config="q30s",
        routing="uniform",
        variant="router",
        status="ok",
        fwd_ms=0.5,
        fwd_tflops=300.0,
        fwd_pct_matmul=43.0,
        fwd_bwd_ms=1.5,
        fwd_bwd_tflops=310.0,
        fwd_bwd_pct_matmul=44.0,
        peak_gib=3.7,
        peak_by_call=True,
    )
    header, line = report.table([row], 698.0).splitlines()[1:]
    assert line.startswith(row["impl"] + "  q30s") and header.index("config") == line.index("q30s")
    assert header.index("variant") == line.index("router")


def test_bench_ep_emulated_shards_on_one_cpu_device(tmp_path):
    # 4 emulated shards under vmap on one device: xla measured, ragged recorded as failed (exit 1), the JSON
    # names the emulation and every row has its times or its error. One sample of one call: the plumbing only.
    out = tmp_path / "ep.json"
    proc = run_script(
        "bench_ep.py",
        str(out),
        "--config",
        "tiny",
        "--emulate",
        "4",
        "--transport",
        "xla,ragged",
        "--routing",
        "uniform",
        "--samples",
        "1",
        "--calls",
        "1",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        proc.stderr.strip().splitlines()[-1]
        == "bench_ep.py: error: transports failed: ragged (errors in the table and JSON)"
    )
    result = json.loads(out.read_text())
    assert result["config"]["emulated_shards"] == 4 and result["failed_transports"] == ["ragged"]
    assert result["config"]["transports"] == ["xla", "ragged"]
    assert result["timing"].startswith("median over 1 samples of 1 back-to-back calls")
    baseline, xla, ragged = result["rows"]
    assert baseline["impl"] == "moe_ffn" and xla["impl"] == "moe_ffn_ep(emulated R=4, transport=xla)"
    assert xla["forward_ms"] > 0 and xla["forward_ratio"] == pytest.approx(xla["forward_ms"] / baseline["forward_ms"])
    assert "transport='ragged'" in ragged["error"]


def test_bench_ep_runs_the_fp8_recipe_on_both_sides(tmp_path):
    out = tmp_path / "ep.json"
    proc = run_script(
        "bench_ep.py",
        str(out),
        *("--config", "tiny", "--emulate", "2", "--routing", "zipf", "--recipe", "fp8_blockwise"),
        *("--samples", "1", "--calls", "1"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["config"]["recipe"] == "fp8_blockwise" and result["failed_transports"] == []
    baseline, xla = result["rows"]
    assert baseline["forward_backward_ms"] > 0 and xla["forward_backward_ms"] > 0


def test_bench_ep_emulate_refuses_a_mesh():
    proc = run_script("bench_ep.py", "/dev/null", "--emulate", "2", "--ep", "2", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "usage: bench_ep.py [options] json_path  (--help lists them)",
        "bench_ep.py: error: --emulate R needs R >= 1 and no --ep (got --emulate 2, --ep 2)",
    ]


def test_profile_ep_sums_complete_events_per_device_process():
    from benchmarks import profile_ep

    trace = {
        "traceEvents": [
            {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:1"}},
            {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "X", "pid": 1, "tid": 7, "ts": 0, "dur": 300.0, "name": "gemm"},
            {"ph": "X", "pid": 1, "tid": 8, "ts": 10, "dur": 100.0, "name": "gemm"},
            {"ph": "X", "pid": 1, "tid": 7, "ts": 400, "dur": 50.0, "name": "nccl"},
            {"ph": "X", "pid": 2, "tid": 7, "ts": 0, "dur": 20.0, "name": "nccl"},
            {"ph": "i", "pid": 1, "tid": 7, "ts": 5, "name": "marker"},  # not a complete event
            {"ph": "X", "pid": 3, "tid": 1, "ts": 0, "dur": 999.0, "name": "host"},  # not a GPU
        ]
    }
    profile = profile_ep.per_step(profile_ep.kernel_times(trace, profile_ep.DEVICE_PROCESS), iters=2)
    assert sorted(profile) == ["/device:GPU:0", "/device:GPU:1"]
    gpu0 = profile["/device:GPU:0"]
    assert gpu0["events"] == [{"name": "gemm", "ms": 0.2, "calls": 1.0}, {"name": "nccl", "ms": 0.025, "calls": 0.5}]
    assert gpu0["total_ms"] == pytest.approx(0.225)
    assert profile["/device:GPU:1"]["events"] == [{"name": "nccl", "ms": 0.01, "calls": 0.5}]


def test_profile_ep_lays_out_the_last_step_in_time():
    from benchmarks import profile_ep

    # Three steps on GPU 0, told apart by the two longest idle gaps; within the last, a gap shorter than those and an
    # event on a second stream that overlaps the first.
    events = [
        (7, 0, 10, "a"),
        (7, 12, 5, "b"),
        (7, 500, 10, "a"),
        (8, 505, 20, "c"),
        (7, 1000, 10, "a"),
        (8, 1003, 2, "c"),
        (7, 1040, 30, "d"),
    ]
    trace = {
        "traceEvents": [
            {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7"}},
            {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "X", "pid": 3, "tid": 1, "ts": 2000, "dur": 9.0, "name": "host"},  # not a GPU
            *({"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": name} for tid, ts, dur, name in events),
        ]
    }
    timeline = profile_ep.last_step_timeline(trace, profile_ep.DEVICE_PROCESS, iters=3)
    assert timeline == {
        "/device:GPU:0": [
            {"stream": "Stream #7", "start_us": 0.0, "dur_us": 10.0, "name": "a"},
            {"stream": "8", "start_us": 3.0, "dur_us": 2.0, "name": "c"},
            {"stream": "Stream #7", "start_us": 40.0, "dur_us": 30.0, "name": "d"},
        ]
    }


def test_profile_ep_runs_on_two_cpu_devices(tmp_path):
    # The whole script on the host platform (no GPU processes in the trace there: the CPU's events instead).
    proc = run_script(
        "profile_ep.py",
        str(tmp_path),
        "--config",
        "tiny",
        "--ep",
        "2",
        "--iters",
        "2",
        "--process",
        "/host:CPU",
        devices=2,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "profile_ep.json").read_text())
    assert result["ranks"] == 2 and result["transport"] == "xla" and not result["emulated"]
    events = result["per_step"]["/host:CPU"]["events"]
    assert events and all(row["ms"] >= 0 for row in events)


def test_train_record_agreement_compares_eval_losses_and_window_means():
    from benchmarks import train_record

    cuda = [{"step": s, "loss": 2.0 + (0.1 if s % 2 else -0.1)} for s in range(1, 8)] + [
        {"step": 4, "eval_loss": 1.5},
        {"step": 7, "eval_loss": 1.2},
    ]
    baseline = [{"step": s, "loss": 2.0} for s in range(1, 10)] + [
        {"step": 4, "eval_loss": 1.5},
        {"step": 8, "eval_loss": 1.0},
    ]
    result = train_record.agreement(cuda, baseline, window=2)
    # Eval losses only where both runs measured (step 4); windows only as far as the shorter run (7 -> 3).
    assert result["eval_loss"] == {"relative_gaps": [(4, 0.0)], "within_1pct": True}
    windows = result["train_loss_2_step_means"]
    assert [key for key, _ in windows["relative_gaps"]] == ["1-2", "3-4", "5-6"]
    assert all(abs(g) < 1e-12 for _, g in windows["relative_gaps"]) and windows["within_1pct"]
    off = train_record.agreement([{"step": 1, "loss": 2.05}, {"step": 2, "loss": 2.0}], baseline[:2], window=2)
    assert off["train_loss_2_step_means"]["relative_gaps"] == [("1-2", pytest.approx(0.0125))]
    assert not off["train_loss_2_step_means"]["within_1pct"] and not off["eval_loss"]["within_1pct"]


def test_bench_moe_runs_every_variant_of_the_jax_peers_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_script(
        "bench_moe.py",
        "--configs",
        "tiny",
        "--routings",
        "zipf",
        "--impls",
        "ragged_dot,gshard",
        "--variants",
        "plain,router,remat",
        "--samples",
        "1",
        "--inner",
        "1",
        "--json",
        str(out),
        "--png",
        str(tmp_path / "bench.png"),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The torch matmul row fails on a CPU; the others are this run's rows.
    rows = [r for r in json.loads(out.read_text())["rows"] if r["impl"] != "bf16_matmul_8192"]
    assert sorted((r["impl"], r["variant"]) for r in rows) == sorted(
        (impl, variant) for impl in ("ragged_dot", "gshard") for variant in ("plain", "router", "remat")
    )
    for r in rows:
        assert r["status"] == "ok", r
        assert r["config"] == "tiny" and r["routing"] == "zipf" and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0


def _float32_problem(seed=0):
    """The tiny config's float32 x, w_gate_up, w_down, cotangent and a router's weights (moe_cases' draws)."""
    import jax.numpy as jnp
    from moe_cases import Case, make_problem, normal

    t, h, i, e, k = shapes.CONFIGS["tiny"]
    (x, _, _, gu, d), dy = make_problem(Case(t, h, i, e, k), jnp.float32, seed=("bench", seed))
    return x, gu, d, dy, normal(("router", seed), (h, e), scale=h**-0.5), k


@pytest.mark.parametrize("variant", ["plain", "router", "remat"])
def test_bench_moe_variants_of_the_ragged_dot_peer_match_the_reference(variant):
    # Each variant of a peer must compute what the same variant of reference.moe_ffn does, gradients included
    # (the router's gradient reaches w_router): a benchmark row is only worth comparing if it is right.
    import jax
    import jax.numpy as jnp
    from moe_cases import rel_error

    from jax_megamoe import reference

    x, gu, d, dy, w_router, k = _float32_problem()
    e = gu.shape[0]
    r1, r2 = (
        (w_router, shapes.log_prior(e, "zipf", jnp))
        if variant == "router"
        else jax_impls.jax_routing(x.shape[0], e, k, "zipf", seed=1)
    )

    def value_and_grads(moe):
        fn = jax_impls.jax_variant(moe, variant, k)
        return jax.value_and_grad(lambda a, b, c, f: jnp.sum(fn(a, b, r2, c, f) * dy), argnums=(0, 1, 2, 3))(
            x, r1, gu, d
        )

    got, want = value_and_grads(jax_impls.jax_impl("ragged_dot")), value_and_grads(reference.moe_ffn)
    assert rel_error(got[0], want[0]) <= 1e-5
    for name, g, w in zip(("x", "r1", "w_gate_up", "w_down"), got[1], want[1], strict=True):
        assert float(jnp.linalg.norm(w)) > 0, name
        assert rel_error(g, w) <= 1e-5, name


def test_bench_moe_torch_variants_compute_the_jax_variants():
    # torch_variant's router and checkpointing, on CPU with a dense stand-in for grouped_mm (whose backward
    # torch implements on GPUs only), against jax_variant over reference.moe_ffn.
    import jax.numpy as jnp
    import numpy as np
    import torch
    import torch.nn.functional as F

    from jax_megamoe import reference

    def dense_moe(x, w, ids, gu, d):
        out = torch.zeros_like(x)
        for j in range(ids.shape[1]):
            g, u = torch.einsum("th,thi->ti", x, gu[ids[:, j]]).chunk(2, dim=-1)
            out = out + w[:, j : j + 1] * torch.einsum("ti,tih->th", F.silu(g) * u, d[ids[:, j]])
        return out

    x, gu, d, dy, w_router, k = _float32_problem(seed=2)
    bias = shapes.log_prior(gu.shape[0], "zipf", np)
    want = jax_impls.jax_variant(reference.moe_ffn, "router", k)(x, w_router, jnp.asarray(bias), gu, d)
    tx, tr, tgu, td, tdy = (torch.tensor(np.asarray(a)) for a in (x, w_router, gu, d, dy))
    tbias = torch.tensor(bias)
    got = torch_impls.torch_variant(dense_moe, "router", k)(tx, tr, tbias, tgu, td)
    np.testing.assert_allclose(got.numpy(), np.asarray(want), rtol=1e-4, atol=1e-5)

    weights, ids = torch.rand(x.shape[0], k), torch.randint(0, gu.shape[0], (x.shape[0], k))

    def grads(variant):
        params = [a.clone().requires_grad_() for a in (tx, weights, tgu, td)]
        y = torch_impls.torch_variant(dense_moe, variant, k)(params[0], params[1], ids, params[2], params[3])
        return torch.autograd.grad(y, params, tdy)

    for plain, remat in zip(grads("plain"), grads("remat"), strict=True):
        assert float(plain.norm()) > 0 and torch.allclose(plain, remat, rtol=1e-5, atol=1e-5)


def test_bench_moe_remat_runs_the_forward_twice():
    # The timed forward+backward returns y, as a training step uses it: under jax.checkpoint the compiled program
    # then runs the forward's two products again in the backward. (Without y, XLA dropped the first forward, whose
    # results nothing used, and `remat` timed the same program as `plain`.)
    import jax

    x, gu, d, dy, _, k = _float32_problem()
    w, ids = jax_impls.jax_routing(x.shape[0], gu.shape[0], k, "uniform", seed=3)

    def products(variant):
        fwd_bwd = jax_impls.forward_and_gradients(jax_impls.jax_variant(jax_impls.jax_impl("ragged_dot"), variant, k))
        return jax.jit(fwd_bwd).lower(x, w, ids, gu, d, dy).compile().as_text().count(" dot(")

    assert products("remat") == products("plain") + 2


def _scaled_grouped_mm_on_cpu(a, b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
    """`torch._scaled_grouped_mm`'s rowwise contract in float32 on the CPU: `a [M, K] @ b [E, K, N]` per group of
    rows, or `a [N, P] @ b [P, K]` per group of the P columns (the weight gradient, `[E, N, K]`), the scales
    multiplying a's rows and b's columns."""
    import torch

    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[2])
        for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
            out[s:e] = (a[s:e].float() * scale_a[s:e, None]) @ (b[g].float() * scale_b[g][None, :])
        return out.to(torch.bfloat16)
    n, k = a.shape[0], b.shape[1]
    out = torch.zeros(len(ends), n, k)
    for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
        lhs = a[:, s:e].float() * scale_a[g * n : (g + 1) * n, None]
        out[g] = lhs @ (b[s:e].float() * scale_b[g * k : (g + 1) * k][None, :])
    return out.to(torch.bfloat16)


def test_bench_moe_torch_fp8_peer_computes_the_moe(monkeypatch):
    """The FP8 rowwise peer's padding, layouts and scales, with its GEMM emulated: its results lie near the bf16
    formulation's (FP8's rounding) and not on them (the operands were quantised)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _scaled_grouped_mm_on_cpu, raising=False)
    monkeypatch.setattr(torch, "compile", lambda fn: fn)
    monkeypatch.setattr(
        torch,
        "_grouped_mm",
        lambda a, b, offs: _scaled_grouped_mm_on_cpu(
            a, b, torch.ones(a.shape[0]), torch.ones(b.shape[0], b.shape[2]), offs
        ),
        raising=False,
    )
    t, h, i, e, k = 96, 128, 64, 8, 2
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(t, h, generator=gen).bfloat16()
    gu = (torch.randn(e, h, 2 * i, generator=gen) / h**0.5).bfloat16()
    d = (torch.randn(e, i, h, generator=gen) / i**0.5).bfloat16()
    dy = torch.randn(t, h, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(t)])  # expert e-1 stays empty
    w = torch.softmax(torch.randn(t, k, generator=gen), -1)
    params = [p.requires_grad_() for p in (x, w, gu, d)]
    results = {}
    for name, (make, align) in torch_impls.TORCH_IMPLS.items():
        y = torch_impls.torch_moe(make(), align)(params[0], params[1], ids, params[2], params[3])
        results[name] = [y.detach().float(), *(g.float() for g in torch.autograd.grad(y, params, dy))]
    for fp8, bf16 in zip(results["torch_fp8_rowwise"], results["torch_grouped_mm"], strict=True):
        err = float((fp8 - bf16).norm() / bf16.norm())
        assert 1e-3 < err < 0.1, err


def test_bench_moe_decode_rows_get_their_floor():
    # A decode-size row: the touched experts' weights plus x and y over the run's read bandwidth.
    t, h, i, e, k = shapes.CONFIGS["q30-t64"]
    assert (t, h, i, e, k) == (64, 2048, 768, 128, 8)
    touched = 120
    expected_bytes = touched * 3 * h * i * 2 + 2 * t * h * 2
    assert rates.floor_bytes((t, h, i, e, k), touched) == expected_bytes
    row = dict(impl="ours", config="q30-t64", routing="uniform", variant="plain", status="ok", fwd_ms=0.5)
    row.update(fwd_bwd_ms=1.5, peak_gib=2.0, peak_by_call=True, experts_touched=touched)
    row = rates.with_rates(row, matmul_tfs=800.0, bandwidth_gbs=4000.0)
    assert row["floor_ms"] == pytest.approx(expected_bytes / 4000e9 * 1e3)  # 4000 GB/s, in ms
    assert row["fwd_over_floor"] == pytest.approx(0.5 / row["floor_ms"])
    big = dict(impl="ours", config="q30", routing="uniform", variant="plain", status="ok", fwd_ms=2.6)
    big.update(fwd_bwd_ms=6.8, peak_gib=9.0, peak_by_call=True, experts_touched=128)
    assert "floor_ms" not in rates.with_rates(big, 800.0, 4000.0)  # compute-bound sizes have no such floor
    failed = dict(impl="tokamax", config="q235-t8", routing="zipf", variant="plain", status="OOM: x")
    text = report.table([row, big, failed], 800.0, 4000.0)
    assert "read bandwidth" in text and "x floor" in text
    line = next(line for line in text.splitlines() if "q30-t64" in line)
    assert f"{row['floor_ms']:.3f}" in line and f"{row['fwd_over_floor']:.2f}" in line
    assert report.table([big], 800.0).count("floor") == 0  # no decode rows, no floor columns


def test_bench_generate_runs_both_frameworks_on_the_tiny_model(tmp_path):
    out = tmp_path / "generate.json"
    proc = run_script(
        "bench_generate.py",
        *("--models", "tiny", "--batches", "2", "--prompt", "8", "--new", "3", "--samples", "1"),
        *("--json", str(out)),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    bandwidth, ours, peer = result["rows"]
    assert bandwidth["impl"] == "read_bandwidth" and result["read_gb_per_s"] == bandwidth["gb_per_s"] > 0
    assert (ours["framework"], peer["framework"]) == ("ours", "transformers")
    for row in (ours, peer):
        assert row["status"] == "ok" and row["batch"] == 2 and row["generate_s"] > 0
        assert row["tokens_per_s"] == pytest.approx(2 * 3 / row["generate_s"])
        assert row["floor_ms"] > 0 and row["step_over_floor"] == pytest.approx(row["step_ms"] / row["floor_ms"])
    assert ours["floor_ms"] == peer["floor_ms"]  # one model, one batch: one floor
    assert "vs transformers" in proc.stdout and "x floor" in proc.stdout


def test_bench_generate_step_floor_counts_the_touched_experts():
    from benchmarks import bench_generate
    from jax_megamoe.models import qwen3_moe

    config = qwen3_moe.tiny()
    h, e, k, i = config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size
    one = bench_generate.step_floor_bytes(config, 1, 0)
    many = bench_generate.step_floor_bytes(config, 1000, 0)
    # One row touches K experts per layer, a large batch all E; the difference is the untouched experts' weights.
    assert many - one == pytest.approx(config.num_hidden_layers * (e - k) * 3 * h * i * 2)
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2
    assert bench_generate.step_floor_bytes(config, 1, 10) - one == pytest.approx(10 * per_token)


def test_bench_moe_cpu_times_the_kernels_and_the_reference(tmp_path):
    out = tmp_path / "bench_moe_cpu.json"
    args = ("--tokens", "8,24", "--dtypes", "bfloat16", "--hidden", "16", "--inter", "8", "--experts", "4")
    proc = run_script("bench_moe_cpu.py", *args, "--samples", "2", "--warmup", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert [(row["dtype"], row["tokens"]) for row in result["rows"]] == [("bfloat16", 8), ("bfloat16", 24)]
    for row in result["rows"]:
        for impl in ("cpu", "reference"):
            assert row[f"{impl}_fwd_ms"] > 0 and row[f"{impl}_fwd_bwd_ms"] > 0
    assert result["shape"] == dict(hidden=16, inter=8, experts=4, top_k=2)
    assert "| bfloat16 | 24 |" in proc.stdout


@pytest.mark.parametrize("flags", [("--tokens", "0"), ("--dtypes", "float16"), ("--top-k", "9")])
def test_bench_moe_cpu_rejects_a_bad_command_line(flags):
    proc = run_script("bench_moe_cpu.py", *flags)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("bench_moe_cpu.py: error: ")
