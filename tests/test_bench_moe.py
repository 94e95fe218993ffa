"""CPU tests of benchmarks/bench_moe.py (the MoE layer against its peers, its parts in benchmarks/moe_bench/): the
implementations' names, the table, the JAX peers' every variant through the script, each peer's variants against
the reference, the torch peers on the CPU, and the decode rows' floors."""

from __future__ import annotations

import json

import pytest
from bench_scripts import run_script

from benchmarks.moe_bench import children, impls, jax_impls, rates, report, shapes, torch_impls


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
    names = dict(impl="ours_tiles_fwd_gate_up=coop_128x256+fwd_down=coop_128x256", config="q30s", routing="uniform")
    times = dict(fwd_ms=0.5, fwd_tflops=300.0, fwd_pct_matmul=43.0, fwd_bwd_ms=1.5, fwd_bwd_tflops=310.0)
    row = dict(
        **names, **times, variant="router", status="ok", fwd_bwd_pct_matmul=44.0, peak_gib=3.7, peak_by_call=True
    )
    header, line = report.table([row], 698.0).splitlines()[1:]
    assert line.startswith(row["impl"] + "  q30s") and header.index("config") == line.index("q30s")
    assert header.index("variant") == line.index("router")


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
