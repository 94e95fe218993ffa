"""The NVLink transport's CPU-checkable parts: workspace sizing, fill values, argument checks, and for the
overlapped forward and backward (nvlink_experts.py) their fine layout, when they apply, and the FFI calls they
lower to (lowered for CUDA on the CPU against the handler's contract; nothing runs).

The kernels themselves run in tests/test_nvlink_gpu.py (emulated shards on one GPU, and two GPUs).
"""

from __future__ import annotations

import functools
import re
import socket
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_megamoe as jmm
from jax_megamoe import _ffi
from jax_megamoe.ops.moe import moe_layout
from jax_megamoe.parallel import nvlink, nvlink_experts


def test_block_bytes_is_the_widest_row_times_tokens():
    # q30 at bf16: token rows (2048 x 2 B) are wider than the 8 ids or weights (8 x 4 B).
    assert nvlink.block_bytes(16384, 2048, 8, jnp.bfloat16) == 16384 * 4096
    # A narrow layer with a wide fan-out: the routing rows set the size.
    assert nvlink.block_bytes(10, 2, 8, jnp.float32) == 10 * 32


@pytest.mark.parametrize("name, value", [("max_tokens", 0), ("hidden", -1), ("top_k", 2.0), ("max_tokens", True)])
def test_block_bytes_rejects_bad_sizes(name, value):
    sizes = dict(max_tokens=4, hidden=8, top_k=2)
    sizes[name] = value
    with pytest.raises(ValueError, match=name):
        nvlink.block_bytes(dtype=jnp.float32, **sizes)


def test_fill_bytes():
    assert nvlink._fill_byte(jnp.bfloat16, 0) == 0
    assert nvlink._fill_byte(jnp.int32, -1) == 0xFF
    with pytest.raises(ValueError, match="fills with 0"):
        nvlink._fill_byte(jnp.float32, -1)


def test_workspace_needs_gpus():
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    with pytest.raises(ValueError, match="GPU|CUDA kernels"):
        jmm.NvlinkWorkspace(mesh, "expert", max_tokens=8, hidden=16, top_k=2, dtype=jnp.float32)
    with pytest.raises(ValueError, match="GPU|CUDA kernels"):
        jmm.NvlinkWorkspace.emulated(2, max_tokens=8, hidden=16, top_k=2, dtype=jnp.float32)


def test_workspace_rejects_unknown_axis():
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    with pytest.raises(ValueError, match="not an axis"):
        jmm.NvlinkWorkspace(mesh, "expert", max_tokens=8, hidden=16, top_k=2)


def _run_ep(**options):
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    spec = P("expert")
    x = jnp.ones((8, 16))
    weights = jnp.full((8, 2), 0.5)
    ids = jnp.tile(jnp.array([[0, 3]], jnp.int32), (8, 1))
    w_gate_up, w_down = jnp.ones((4, 16, 8)), jnp.ones((4, 4, 16))
    fn = jax.shard_map(functools.partial(jmm.moe_ffn_ep, **options), mesh=mesh, in_specs=(spec,) * 5,
                       out_specs=spec)
    return fn(x, weights, ids, w_gate_up, w_down)


def test_nvlink_backend_needs_a_workspace():
    with pytest.raises(ValueError, match="needs workspace=NvlinkWorkspace"):
        _run_ep(backend="nvlink")


def test_workspace_only_with_nvlink():
    with pytest.raises(ValueError, match="only used by backend='nvlink'"):
        _run_ep(backend="xla", workspace=object())


class _FakeStore:
    """The jax.distributed key-value store of two processes, as seen by one of them."""

    def __init__(self, peers):
        self.values = dict(peers)
        self.set_keys = []

    def key_value_set_bytes(self, key, value):
        self.set_keys.append(key)
        self.values[key] = value

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        return self.values[key]


class _FakeExtension:
    def __init__(self, exported):
        self.exported = exported
        self.attached = []

    def nvlink_export(self, workspace_id):
        return self.exported

    def nvlink_attach(self, workspace_id, group, rank, handles):
        self.attached.append((workspace_id, group, rank, handles))


def test_ipc_handles_are_swapped_under_global_group_names(monkeypatch):
    from jax._src import distributed
    host = socket.gethostname().encode()
    # This process holds rank 1 of global group 3 (its only group); rank 0 belongs to another process.
    # Binary handles may contain the separator: only the first newline ends the host name.
    store = _FakeStore({"jax_megamoe/nvlink/7/3/0": host + b"\npe\ner"})
    monkeypatch.setattr(distributed.global_state, "client", store)
    ext = _FakeExtension([b"mine"])
    nvlink._exchange_handles(ext, 42, [[nvlink.REMOTE, 0]], [3], 7)
    assert store.set_keys == ["jax_megamoe/nvlink/7/3/1"]
    assert store.values["jax_megamoe/nvlink/7/3/1"] == host + b"\nmine"
    assert ext.attached == [(42, 0, 0, b"pe\ner")]


def test_ipc_peer_on_another_host_is_refused(monkeypatch):
    from jax._src import distributed
    store = _FakeStore({"jax_megamoe/nvlink/1/0/0": b"elsewhere-node\nhandles"})
    monkeypatch.setattr(distributed.global_state, "client", store)
    ext = _FakeExtension([b"mine"])
    with pytest.raises(ValueError, match="rank 0 is on host 'elsewhere-node'.*backend='xla'"):
        nvlink._exchange_handles(ext, 1, [[nvlink.REMOTE, 0]], [0], 1)
    assert ext.attached == []


def test_ipc_needs_jax_distributed(monkeypatch):
    from jax._src import distributed
    monkeypatch.setattr(distributed.global_state, "client", None)
    with pytest.raises(ValueError, match="jax.distributed.initialize"):
        nvlink._exchange_handles(_FakeExtension([b"x"]), 1, [[nvlink.REMOTE, 0]], [0], 1)


@pytest.mark.parametrize("value", ["0", "1025", "x", "-3"])
def test_bad_blocks_per_peer_env(monkeypatch, value):
    monkeypatch.setenv("JMM_NVLINK_BLOCKS_PER_PEER", value)
    with pytest.raises(ValueError, match="JMM_NVLINK_BLOCKS_PER_PEER"):
        nvlink._positive_env("JMM_NVLINK_BLOCKS_PER_PEER", 16, 1024)


@pytest.mark.parametrize("overlap", ["yes", 1, None])
def test_overlap_must_be_a_bool(overlap):
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    with pytest.raises(TypeError, match="overlap must be a bool.*got"):
        jmm.NvlinkWorkspace(mesh, "expert", max_tokens=8, hidden=16, top_k=2, overlap=overlap)
    with pytest.raises(TypeError, match="overlap must be a bool.*got"):
        jmm.NvlinkWorkspace.emulated(2, max_tokens=8, hidden=16, top_k=2, overlap=overlap)


def fine_keys_model(recv_ids: np.ndarray) -> np.ndarray:
    """keys[t, k] = recv_ids[t, k] * ep + t // C for the flattened rows t, -1 where the id is negative."""
    ep, capacity, top_k = recv_ids.shape
    flat = recv_ids.reshape(ep * capacity, top_k)
    source = (np.arange(ep * capacity) // capacity)[:, None]
    return np.where(flat >= 0, flat * ep + source, -1)


@pytest.mark.parametrize("ep", [2, 3, 4, 8])
def test_fine_layout_has_the_plain_expert_layouts_row_order(ep):
    """The overlapped forward sorts the received pairs by (local expert, source); that must be the plain
    expert layout (whose row order the existing backward uses), with its expert offsets every ep-th entry."""
    local_experts, capacity, top_k = 5, 7, 3
    rng = np.random.default_rng(ep)
    recv_ids = rng.integers(0, local_experts, (ep, capacity, top_k)).astype(np.int32)
    recv_ids[rng.random(recv_ids.shape) < 0.3] = -1     # empty slots and unrouted columns
    recv_ids[-1, capacity // 2:] = -1                    # a partly filled block
    recv_ids[recv_ids == 2] = 4                          # an expert with no pair
    keys = nvlink_experts.fine_keys(jnp.asarray(recv_ids))
    np.testing.assert_array_equal(np.asarray(keys), fine_keys_model(recv_ids))

    fine = moe_layout(keys, local_experts * ep, "cpu")
    plain = moe_layout(jnp.asarray(recv_ids.reshape(ep * capacity, top_k)), local_experts, "cpu")
    np.testing.assert_array_equal(np.asarray(fine.row_of_pair), np.asarray(plain.row_of_pair))
    np.testing.assert_array_equal(np.asarray(fine.pair_of_row), np.asarray(plain.pair_of_row))
    np.testing.assert_array_equal(np.asarray(fine.expert_offsets)[::ep], np.asarray(plain.expert_offsets))
    # And the fine groups themselves: group (e, s) holds the pairs of expert e received from source s.
    counts = np.bincount(fine_keys_model(recv_ids)[recv_ids.reshape(-1, top_k) >= 0], minlength=local_experts * ep)
    np.testing.assert_array_equal(np.diff(np.asarray(fine.expert_offsets)), counts)


@pytest.mark.parametrize("overlap, platform, dtype, hidden, inter, applies", [
    (True, "cuda", jnp.bfloat16, 128, 64, True),
    (False, "cuda", jnp.bfloat16, 128, 64, False),     # the workspace asks for stage 1
    (True, "cuda", jnp.float32, 128, 64, False),       # float32 runs the SIMT path
    (True, "cuda", jnp.bfloat16, 132, 64, False),      # H not a multiple of 8: no tensor cores
    (True, "cuda", jnp.bfloat16, 128, 36, False),      # I not a multiple of 8
    (True, "reference", jnp.bfloat16, 128, 64, False),
    (True, "cpu", jnp.bfloat16, 128, 64, False),
])
def test_overlap_applies_only_to_the_cuda_tensor_core_path(overlap, platform, dtype, hidden, inter, applies):
    workspace = types.SimpleNamespace(overlap=overlap)
    assert nvlink_experts.overlap_applies(workspace, platform, dtype, hidden, inter) is applies


def custom_call_types(text: str, target: str) -> list[tuple[list[str], list[str]]]:
    """(operand types, result types) of every StableHLO custom call to `target` in `text`."""
    calls = []
    for line in text.splitlines():
        if f"@{target}(" in line:
            operands, results = line.rsplit("} : ", 1)[1].split(" -> ")
            calls.append((re.findall(r"tensor<([^>]*)>", operands), re.findall(r"tensor<([^>]*)>", results)))
    return calls


FUSED_WORKSPACE_BYTES = 4096


@pytest.fixture
def cuda_lowering(monkeypatch):
    """Lowering for CUDA on the CPU (nothing runs): a stand-in for the extension's `cuda_workspace_bytes`
    (the CPU build has none), recording what each call asked for; yields that record."""
    asked = []

    def workspace_bytes(op, *dims):
        asked.append((op, *dims))
        return FUSED_WORKSPACE_BYTES if op.startswith("nvlink_moe_") else 256
    monkeypatch.setattr(_ffi, "extension", lambda: types.SimpleNamespace(cuda_workspace_bytes=workspace_bytes))
    yield asked


def stand_in_workspace(ranks: int, overlap: bool) -> nvlink.NvlinkWorkspace:
    """An NvlinkWorkspace with no GPU memory behind it, for lowering only."""
    workspace = nvlink.NvlinkWorkspace.__new__(nvlink.NvlinkWorkspace)
    workspace.id, workspace.ranks, workspace.emulated, workspace.block_bytes = 3, ranks, True, 10**6
    workspace.overlap = overlap
    return workspace


def lower_for_cuda(fn, *shapes) -> str:
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_overlapped_calls_emit_the_ffi_contract(cuda_lowering, monkeypatch):
    """Under vmap over R shards: the fused forward's and backward's operands and results, in order, with their
    shapes, their attributes and the workspace sizes they ask for; the backward's dz is aliased to gate_up, and
    nothing else runs a backward or an exchange."""
    ranks, capacity, hidden, inter, local_experts, top_k = 2, 6, 24, 8, 3, 2
    monkeypatch.setenv("JMM_GEMM_TILES", "pp64x256_c1")
    workspace = stand_in_workspace(ranks, overlap=True)

    def forward_backward(send, weights, w_gate_up, w_down, ids):
        def forward(s, w, g, d):
            per_shard = functools.partial(nvlink_experts.overlapped_experts, workspace=workspace)
            return jax.vmap(per_shard, axis_name="expert")(s, ids, w, g, d)
        y, vjp = jax.vjp(forward, send, weights, w_gate_up, w_down)
        return y, vjp(y)

    text = lower_for_cuda(
        forward_backward, ((ranks, ranks, capacity, hidden), jnp.bfloat16),
        ((ranks, ranks, capacity, top_k), jnp.float32), ((ranks, local_experts, hidden, 2 * inter), jnp.bfloat16),
        ((ranks, local_experts, inter, hidden), jnp.bfloat16), ((ranks, ranks, capacity, top_k), jnp.int32))

    rows, pairs = ranks * capacity, ranks * capacity * top_k
    r = f"{ranks}x"
    [(operands, results)] = custom_call_types(text, "jmm_cuda_nvlink_moe_forward")
    assert operands == [f"{r}{ranks}x{capacity}x{hidden}xbf16", f"{r}{rows}x{top_k}xf32", f"{r}{local_experts}x{hidden}x{2 * inter}xbf16",
                        f"{r}{local_experts}x{inter}x{hidden}xbf16", f"{r}{pairs}xi32", f"{r}{pairs}xi32",
                        f"{r}{local_experts * ranks + 1}xi32", f"{r}{local_experts + 1}xi32"]
    assert results == [f"{r}{ranks}x{capacity}x{hidden}xbf16", f"{r}{ranks}x{capacity}x{hidden}xbf16",
                       f"{r}{pairs}x{2 * inter}xbf16", f"{r}{FUSED_WORKSPACE_BYTES}xui8"]
    assert re.search(r'jmm_cuda_nvlink_moe_forward.*mhlo.backend_config = \{workspace = 3 : i64\}', text)
    assert ("nvlink_moe_forward", True, rows, top_k, hidden, inter, local_experts * ranks) in cuda_lowering
    [(operands, results)] = custom_call_types(text, "jmm_cuda_nvlink_moe_backward")
    assert operands == [f"{r}{ranks}x{capacity}x{hidden}xbf16", f"{r}{ranks}x{capacity}x{hidden}xbf16",
                        f"{r}{rows}x{top_k}xf32",
                        f"{r}{local_experts}x{hidden}x{2 * inter}xbf16", f"{r}{local_experts}x{inter}x{hidden}xbf16",
                        f"{r}{pairs}x{2 * inter}xbf16", f"{r}{pairs}xi32", f"{r}{pairs}xi32",
                        f"{r}{local_experts * ranks + 1}xi32", f"{r}{local_experts + 1}xi32"]
    assert results == [f"{r}{ranks}x{capacity}x{hidden}xbf16", f"{r}{rows}x{top_k}xf32",
                       f"{r}{local_experts}x{hidden}x{2 * inter}xbf16", f"{r}{local_experts}x{inter}x{hidden}xbf16",
                       f"{r}{pairs}x{2 * inter}xbf16", f"{r}{FUSED_WORKSPACE_BYTES}xui8"]
    assert "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [4], operand_index = 5" \
        in text
    # JMM_GEMM_TILES reaches the backward; the forward's two GEMMs use the gated kernel's fixed tiles.
    assert len(re.findall(r'mhlo.backend_config = \{gemm_tiles = "pp64x256_c1", workspace = 3 : i64\}', text)) == 1
    assert ("nvlink_moe_backward", True, rows, top_k, hidden, inter, local_experts) in cuda_lowering
    # The fine layout: one moe_layout over E_local * ep keys; no other forward, backward or exchange.
    assert [call[1][2] for call in custom_call_types(text, "jmm_cuda_moe_layout")] == [
        f"{local_experts * ranks + 1}xi32"]
    for target in ("jmm_cuda_moe_forward", "jmm_cuda_moe_backward", "jmm_cuda_nvlink_exchange"):
        assert not custom_call_types(text, target)


@pytest.mark.parametrize("overlap, capacity_factor, fused, exchanges, blocks", [
    (True, None, 1, 3, "1x8"),     # dropless: x itself is every destination's block
    (True, 0.5, 1, 3, "2x4"),      # C = 4 < T: compacted send blocks
    (False, None, 0, 7, None)])
def test_moe_ffn_ep_takes_the_overlapped_calls_when_asked(cuda_lowering, monkeypatch, overlap, capacity_factor, fused,
                                                          exchanges, blocks):
    """`moe_ffn_ep`'s nvlink path with the local experts on CUDA, bf16: overlap=True calls the fused forward and
    backward once each and exchanges the ids and weights out and the weights' cotangent back (3); stage 1 also
    the rows, the results, and their cotangents (7). The fused calls take x as their one block ([1, T, H]), return
    y likewise, take its cotangent and return x's likewise when every token has a slot, else [ep, C, H] blocks."""
    from jax_megamoe.parallel import ep
    monkeypatch.setattr(ep, "resolve_backend", lambda backend: "cuda")  # as on a GPU
    ranks, tokens, hidden, inter, experts, top_k = 2, 8, 16, 8, 4, 2
    per_shard = functools.partial(jmm.moe_ffn_ep, axis_name="expert", backend="nvlink", capacity_factor=capacity_factor,
                                  workspace=stand_in_workspace(ranks, overlap))

    def forward_backward(x, weights, ids, w_gate_up, w_down):
        fn = jax.vmap(per_shard, axis_name="expert")
        y, vjp = jax.vjp(lambda a, b, c, d: fn(a, b, ids, c, d), x, weights, w_gate_up, w_down)
        return y, vjp(y)

    text = lower_for_cuda(
        forward_backward, ((ranks, tokens, hidden), jnp.bfloat16), ((ranks, tokens, top_k), jnp.float32),
        ((ranks, tokens, top_k), jnp.int32), ((ranks, experts // ranks, hidden, 2 * inter), jnp.bfloat16),
        ((ranks, experts // ranks, inter, hidden), jnp.bfloat16))
    assert len(custom_call_types(text, "jmm_cuda_nvlink_moe_forward")) == fused
    assert len(custom_call_types(text, "jmm_cuda_nvlink_moe_backward")) == fused
    for target in ("jmm_cuda_nvlink_moe_forward", "jmm_cuda_nvlink_moe_backward")[:fused * 2]:
        [(operands, results)] = custom_call_types(text, target)
        assert operands[0] == f"{ranks}x{blocks}x{hidden}xbf16"
        # The results (forward) and the rows' cotangent (backward) as the blocks: with x, summed per token.
        assert results[1 if target == "jmm_cuda_nvlink_moe_forward" else 0] == f"{ranks}x{blocks}x{hidden}xbf16"
    # Stage 1: moe_ffn's backward, on this machine's platform (the local backend resolves on its own).
    assert bool(re.search(r"@jmm_c[a-z]*_moe_backward", text)) == (not fused)
    assert len(custom_call_types(text, "jmm_cuda_nvlink_exchange")) == exchanges


@pytest.mark.parametrize("other_process", [False, True])
@pytest.mark.parametrize("asked, expected", [({}, True), ({"overlap": True}, True), ({"overlap": False}, False)])
def test_overlap_is_on_by_default_and_holds_across_processes(monkeypatch, other_process, asked, expected):
    """Stage 2 is the default, and what the caller asks for holds within one process and with one process per
    GPU (CUDA IPC) alike."""
    created = {}

    def fake_create(self, groups, emulated, size, overlap):
        created["overlap"] = overlap
        self.id = 1

    monkeypatch.setattr(nvlink, "_ordinal", lambda d: nvlink.REMOTE if other_process and d.id == 1 else d.id)
    monkeypatch.setattr(nvlink.NvlinkWorkspace, "_create", fake_create)
    monkeypatch.setattr(nvlink, "_exchange_handles", lambda *args: None)
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    nvlink.NvlinkWorkspace(mesh, "expert", max_tokens=4, hidden=8, top_k=1, **asked)
    assert created["overlap"] is expected


def test_every_kernel_file_registers_its_module():
    """The nvlink workspace loads the kernels of the modules registered through jmm/kernel_module.cuh; a .cu file
    that does not include it would have its kernels loaded at their first launch, possibly while a peer GPU spins
    (tests/test_nvlink_gpu.py::test_workspace_loads_every_kernel_of_the_library checks the loading itself)."""
    kernel_files = sorted((Path(__file__).parents[1] / "cuda" / "kernels").glob("*.cu"))
    assert kernel_files
    missing = [f.name for f in kernel_files if '#include "jmm/kernel_module.cuh"' not in f.read_text()]
    assert missing == []
