"""The nvlink transport's CPU-checkable parts: workspace sizing and arguments, the fill values, the IPC handle
swap, `NvlinkTransport` (where it applies, the fallback to "xla" with its warning, the block layout it picks),
and the fused calls it lowers to (lowered for CUDA on the CPU against the handlers' contract, with a stand-in
for the extension's workspace queries; nothing runs): their operands, results, attributes, aliases, and what
jax.checkpoint recomputes of them.

The kernels themselves run in tests/test_nvlink_gpu.py (emulated shards on one GPU, and two GPUs).
"""

from __future__ import annotations

import functools
import re
import socket
import types
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from moe_cases import Case, make_problem, seeded_rng, split_shards, value_and_grads

import jax_megamoe as jmm
from jax_megamoe import _ffi, _targets
from jax_megamoe.ops import fp8
from jax_megamoe.ops import moe as moe_ops
from jax_megamoe.ops.moe import moe_layout
from jax_megamoe.parallel import ep as ep_module
from jax_megamoe.parallel.nvlink import exchange, fused, workspace
from jax_megamoe.parallel.nvlink.transport import NvlinkTransport

ROOT = Path(__file__).resolve().parents[1]


def test_block_bytes_is_the_widest_row_times_tokens():
    # q30 at bf16: token rows (2048 x 2 B) are wider than the 8 ids or weights (8 x 4 B).
    assert workspace.block_bytes(16384, 2048, 8, jnp.bfloat16) == 16384 * 4096
    # A narrow layer with a wide fan-out: the routing rows set the size.
    assert workspace.block_bytes(10, 2, 8, jnp.float32) == 10 * 32
    assert jmm.parallel.nvlink.block_bytes is workspace.block_bytes


@pytest.mark.parametrize("name, value", [("max_tokens", 0), ("hidden", -1), ("top_k", 2.0), ("max_tokens", True)])
def test_block_bytes_rejects_bad_sizes(name, value):
    sizes = dict(max_tokens=4, hidden=8, top_k=2)
    sizes[name] = value
    with pytest.raises(ValueError, match=name):
        workspace.block_bytes(dtype=jnp.float32, **sizes)


def test_fill_bytes():
    assert exchange._fill_byte(jnp.bfloat16, 0) == 0
    assert exchange._fill_byte(jnp.int32, -1) == 0xFF
    with pytest.raises(ValueError, match="fills with 0"):
        exchange._fill_byte(jnp.float32, -1)


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


@pytest.mark.parametrize(
    "name, value",
    [
        ("timeout_ms", 0),
        ("timeout_ms", -5),
        ("timeout_ms", 1.5),
        ("blocks_per_peer", 0),
        ("blocks_per_peer", 1025),
        ("blocks_per_peer", "16"),
        ("blocks_per_peer", True),
    ],
)
def test_timeout_and_blocks_per_peer_are_checked_arguments(monkeypatch, name, value):
    monkeypatch.setattr(workspace, "_ordinal", lambda device: 0)  # as on a GPU: the arguments are checked first
    monkeypatch.setattr(workspace, "_cuda_extension", _FakeExtension)
    with pytest.raises(ValueError, match=name):
        jmm.NvlinkWorkspace.emulated(2, max_tokens=8, hidden=16, top_k=2, **{name: value})


def test_overlap_and_environment_knobs_are_gone(monkeypatch):
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    with pytest.raises(TypeError, match="overlap"):
        jmm.NvlinkWorkspace(mesh, "expert", max_tokens=8, hidden=16, top_k=2, overlap=True)
    with pytest.raises(TypeError, match="overlap"):
        jmm.NvlinkWorkspace.emulated(2, max_tokens=8, hidden=16, top_k=2, overlap=True)


class _FakeExtension:
    """The CUDA build's workspace lifecycle, recording what it was asked."""

    def __init__(self, exported=(b"mine",)):
        self.exported = list(exported)
        self.created, self.attached, self.destroyed = [], [], []

    def nvlink_create(self, groups, emulated, block_bytes, timeout_ms, blocks_per_peer):
        self.created.append(
            dict(
                groups=groups,
                emulated=emulated,
                block_bytes=block_bytes,
                timeout_ms=timeout_ms,
                blocks_per_peer=blocks_per_peer,
            )
        )
        return 7

    def nvlink_destroy(self, workspace_id):
        self.destroyed.append(workspace_id)

    def nvlink_export(self, workspace_id):
        return self.exported

    def nvlink_attach(self, workspace_id, group, rank, handles):
        self.attached.append((workspace_id, group, rank, handles))


@pytest.mark.parametrize("other_process", [False, True])
@pytest.mark.parametrize(
    "asked, expected", [({}, (10_000, 64)), ({"timeout_ms": 500, "blocks_per_peer": 16}, (500, 16))]
)
def test_timeout_and_blocks_per_peer_reach_the_extension(monkeypatch, other_process, asked, expected):
    """The workspace's arguments (not an environment variable) reach nvlink_create, within one process and with
    one process per GPU (CUDA IPC) alike; defaults 10 s and 64."""
    ext = _FakeExtension()
    swapped = []
    monkeypatch.setattr(workspace, "_cuda_extension", lambda: ext)
    monkeypatch.setattr(_ffi, "extension", lambda: ext)
    monkeypatch.setattr(workspace, "_ordinal", lambda d: workspace.REMOTE if other_process and d.id == 1 else d.id)
    monkeypatch.setattr(workspace, "_exchange_handles", lambda *args: swapped.append(args))
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    ws = jmm.NvlinkWorkspace(mesh, "expert", max_tokens=4, hidden=8, top_k=1, dtype=jnp.float32, **asked)
    [created] = ext.created
    assert (created["timeout_ms"], created["blocks_per_peer"]) == expected
    assert created["groups"] == ([[0, workspace.REMOTE]] if other_process else [[0, 1]])
    assert created["block_bytes"] == workspace.block_bytes(4, 8, 1, jnp.float32) and not created["emulated"]
    assert len(swapped) == int(other_process)
    assert (ws.id, ws.ranks, ws.is_emulated) == (7, 2, False)
    ws.close()
    assert ext.destroyed == [7]
    emulated = jmm.NvlinkWorkspace.emulated(4, max_tokens=4, hidden=8, top_k=1, **asked)
    assert ext.created[1]["emulated"] and len(ext.created[1]["groups"][0]) == 4 and emulated.ranks == 4
    assert (ext.created[1]["timeout_ms"], ext.created[1]["blocks_per_peer"]) == expected


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


def test_ipc_handles_are_swapped_under_global_group_names(monkeypatch):
    from jax._src import distributed

    host = socket.gethostname().encode()
    # This process holds rank 1 of global group 3 (its only group); rank 0 belongs to another process.
    # Binary handles may contain the separator: only the first newline ends the host name.
    store = _FakeStore({"jax_megamoe/nvlink/7/3/0": host + b"\npe\ner"})
    monkeypatch.setattr(distributed.global_state, "client", store)
    ext = _FakeExtension([b"mine"])
    workspace._exchange_handles(ext, 42, [[workspace.REMOTE, 0]], [3], 7)
    assert store.set_keys == ["jax_megamoe/nvlink/7/3/1"]
    assert store.values["jax_megamoe/nvlink/7/3/1"] == host + b"\nmine"
    assert ext.attached == [(42, 0, 0, b"pe\ner")]


def test_ipc_peer_on_another_host_is_refused(monkeypatch):
    from jax._src import distributed

    store = _FakeStore({"jax_megamoe/nvlink/1/0/0": b"elsewhere-node\nhandles"})
    monkeypatch.setattr(distributed.global_state, "client", store)
    ext = _FakeExtension([b"mine"])
    with pytest.raises(ValueError, match="rank 0 is on host 'elsewhere-node'.*transport='xla'"):
        workspace._exchange_handles(ext, 1, [[workspace.REMOTE, 0]], [0], 1)
    assert ext.attached == []


def test_ipc_needs_jax_distributed(monkeypatch):
    from jax._src import distributed

    monkeypatch.setattr(distributed.global_state, "client", None)
    with pytest.raises(ValueError, match="jax.distributed.initialize"):
        workspace._exchange_handles(_FakeExtension([b"x"]), 1, [[workspace.REMOTE, 0]], [0], 1)


def stand_in_workspace(ranks: int, block_bytes: int = 10**6) -> jmm.NvlinkWorkspace:
    """An NvlinkWorkspace with no GPU memory behind it, for tracing and lowering only."""
    ws = jmm.NvlinkWorkspace.__new__(jmm.NvlinkWorkspace)
    ws.id, ws.ranks, ws.is_emulated, ws.block_bytes = 3, ranks, True, block_bytes
    return ws


def test_the_transport_takes_a_workspace_and_is_hashable_by_identity():
    ws = stand_in_workspace(2)
    transport = jmm.NvlinkTransport(ws)
    assert transport.workspace is ws and transport.name == "nvlink" and isinstance(transport, jmm.Transport)
    assert hash(transport) == hash(transport) and {transport: 1}[transport] == 1
    assert jmm.NvlinkTransport is NvlinkTransport
    with pytest.raises(TypeError, match="NvlinkWorkspace"):
        jmm.NvlinkTransport(object())
    with pytest.raises(ValueError, match="spans 2 shards, the expert axis has 4"):
        transport.check(4)
    transport.check(2)


@pytest.mark.parametrize(
    "implementation, dtype, hidden, inter, reason",
    [
        ("cuda", jnp.bfloat16, 128, 64, None),
        ("cuda", jnp.float32, 128, 64, "bfloat16"),  # float32 runs moe_ffn's SIMT path
        ("cuda", jnp.bfloat16, 132, 64, "multiples of 8"),  # H not a multiple of 8: no tensor cores
        ("cuda", jnp.bfloat16, 128, 36, "multiples of 8"),  # I not a multiple of 8
        ("reference", jnp.bfloat16, 128, 64, "CUDA kernels"),
        ("cpu", jnp.bfloat16, 128, 64, "CUDA kernels"),
    ],
)
def test_the_fused_path_applies_only_to_the_cuda_tensor_core_path(implementation, dtype, hidden, inter, reason):
    why = jmm.NvlinkTransport(stand_in_workspace(2)).unsupported(implementation, dtype, hidden, inter)
    assert (why is None) if reason is None else (reason in why), why


@pytest.mark.parametrize("implementation, hidden, inter, reason", [("cuda", 136, 72, None), ("cpu", 128, 64, "CUDA")])
def test_the_fp8_recipe_runs_on_the_cuda_kernels_at_any_size(implementation, hidden, inter, reason):
    """The recipe pads H and I inside its op, so only the implementation limits the transport."""
    transport = jmm.NvlinkTransport(stand_in_workspace(2))
    why = transport.unsupported(implementation, jnp.bfloat16, hidden, inter, recipe="fp8_blockwise")
    assert (why is None) if reason is None else (reason in why), why


def test_block_layout_follows_the_row_capacity():
    """x itself is every destination's block when every token has a slot there (dropless, or a capacity of
    at least T rows): the plan is then uncompacted; otherwise the rows travel in compacted send blocks, as they
    always do with the FP8 recipe (its rows go by the plain exchange, which moves the live ones)."""
    transport = jmm.NvlinkTransport(stand_in_workspace(2))
    assert transport.compact_rows(tokens=64, row_capacity=64) is False
    assert transport.compact_rows(tokens=64, row_capacity=32) is True
    assert transport.compact_rows(tokens=64, row_capacity=64, recipe="fp8_blockwise") is True


def emulated_ep(ranks, **options):
    return jax.vmap(functools.partial(jmm.moe_ffn_ep, axis_name="expert", **options), axis_name="expert")


def test_falling_back_to_xla_warns_once_naming_why(monkeypatch):
    """On the CPU kernels the fused path cannot run: moe_ffn_ep runs the "xla" transport instead, bit for bit,
    with one UserWarning per reason (not per call) saying why, and no nvlink call in the program."""
    monkeypatch.setattr(ep_module, "_warned", set())
    ranks = 2
    args, dy = make_problem(Case(2 * 16, 16, 8, 8, 2, "zipf"), jnp.float32, seed="fallback")
    args, dy = tuple(split_shards(a, ranks) for a in args), split_shards(dy, ranks)
    nvlink = jax.jit(
        functools.partial(
            value_and_grads,
            emulated_ep(ranks, transport=jmm.NvlinkTransport(stand_in_workspace(ranks)), implementation="cpu"),
        )
    )
    xla = jax.jit(functools.partial(value_and_grads, emulated_ep(ranks, transport="xla", implementation="cpu")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = nvlink.lower(args, dy).as_text()
        got = nvlink(args, dy)
        again = jax.jit(
            functools.partial(
                value_and_grads,
                emulated_ep(ranks, transport=jmm.NvlinkTransport(stand_in_workspace(ranks)), implementation="cpu"),
            )
        )(args, dy)
    fell_back = [w for w in caught if issubclass(w.category, UserWarning)]
    assert len(fell_back) == 1, [str(w.message) for w in fell_back]
    message = str(fell_back[0].message)
    assert "nvlink" in message and "'xla'" in message and "CUDA kernels" in message and "'cpu'" in message
    assert "jmm_cuda_nvlink" not in text
    for a, b, c in zip(got, again, xla(args, dy), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
        np.testing.assert_array_equal(np.asarray(b), np.asarray(c))


def fine_keys_model(recv_ids: np.ndarray) -> np.ndarray:
    """keys[t, k] = recv_ids[t, k] * ep + t // C for the flattened rows t, -1 where the id is negative."""
    ep, capacity, top_k = recv_ids.shape
    flat = recv_ids.reshape(ep * capacity, top_k)
    source = (np.arange(ep * capacity) // capacity)[:, None]
    return np.where(flat >= 0, flat * ep + source, -1)


@pytest.mark.parametrize("ep", [2, 3, 4, 8])
def test_fine_layout_has_the_plain_expert_layouts_row_order(ep):
    """The fused forward sorts the received pairs by (local expert, source); that must be the plain expert
    layout (whose row order moe_ffn's backward uses), with its expert offsets every ep-th entry."""
    local_experts, capacity, top_k = 5, 7, 3
    rng = seeded_rng("fine layout", ep)
    recv_ids = rng.integers(0, local_experts, (ep, capacity, top_k)).astype(np.int32)
    recv_ids[rng.random(recv_ids.shape) < 0.3] = -1  # empty slots and unrouted columns
    recv_ids[-1, capacity // 2 :] = -1  # a partly filled block
    recv_ids[recv_ids == 2] = 4  # an expert with no pair
    keys = fused.fine_keys(jnp.asarray(recv_ids))
    np.testing.assert_array_equal(np.asarray(keys), fine_keys_model(recv_ids))

    fine = moe_layout(keys, local_experts * ep, "cpu")
    plain = moe_layout(jnp.asarray(recv_ids.reshape(ep * capacity, top_k)), local_experts, "cpu")
    np.testing.assert_array_equal(np.asarray(fine.row_of_pair), np.asarray(plain.row_of_pair))
    np.testing.assert_array_equal(np.asarray(fine.pair_of_row), np.asarray(plain.pair_of_row))
    np.testing.assert_array_equal(np.asarray(fine.expert_offsets)[::ep], np.asarray(plain.expert_offsets))
    # And the fine groups themselves: group (e, s) holds the pairs of expert e received from source s.
    counts = np.bincount(fine_keys_model(recv_ids)[recv_ids.reshape(-1, top_k) >= 0], minlength=local_experts * ep)
    np.testing.assert_array_equal(np.diff(np.asarray(fine.expert_offsets)), counts)


# ------------------------------------------------------------------------------------ lowered for CUDA on CPU

NVLINK_CALLS = ("jmm_cuda_nvlink_moe_gate_up", "jmm_cuda_nvlink_moe_down", "jmm_cuda_nvlink_moe_backward")
FUSED_WORKSPACE_BYTES = 4096


def custom_call_types(text: str, target: str) -> list[tuple[list[str], list[str]]]:
    """(operand types, result types) of every StableHLO custom call to `target` in `text`."""
    calls = []
    for line in text.splitlines():
        if f"@{target}(" in line:
            operands, results = line.rsplit("} : ", 1)[1].split(" -> ")
            calls.append((re.findall(r"tensor<([^>]*)>", operands), re.findall(r"tensor<([^>]*)>", results)))
    return calls


def call_lines(text: str, target: str) -> list[str]:
    return [line for line in text.splitlines() if f"@{target}(" in line]


@pytest.fixture
def cuda_lowering(monkeypatch):
    """Lowering for CUDA on the CPU (nothing runs): a stand-in for the CUDA extension's workspace queries (the
    CPU build has none), recording (target, sizes) of each query, and implementation "cuda" accepted at trace
    time; yields that record."""
    asked = []

    def query(name):
        def workspace_bytes(*sizes):
            asked.append((name, *sizes))
            return FUSED_WORKSPACE_BYTES if name.startswith("jmm_cuda_nvlink_moe_") else 256

        return workspace_bytes

    ext = types.SimpleNamespace(
        with_cuda=True, **{t.workspace_query: query(t.name) for t in _targets.all_targets() if t.workspace_query}
    )
    monkeypatch.setattr(_ffi, "extension", lambda: ext)
    cuda = lambda implementation, arrays=(): "cuda"  # noqa: E731 - as on a GPU
    monkeypatch.setattr(moe_ops, "resolve_implementation", cuda)
    monkeypatch.setattr(ep_module, "resolve_implementation", cuda)
    yield asked


def lower_for_cuda(fn, *shapes) -> str:
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


RANKS, TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 2, 8, 16, 8, 4, 2
EP_SHAPES = (
    ((RANKS, TOKENS, HIDDEN), jnp.bfloat16),
    ((RANKS, TOKENS, TOP_K), jnp.float32),
    ((RANKS, TOKENS, TOP_K), jnp.int32),
    ((RANKS, EXPERTS // RANKS, HIDDEN, 2 * INTER), jnp.bfloat16),
    ((RANKS, EXPERTS // RANKS, INTER, HIDDEN), jnp.bfloat16),
)


def ep_step(checkpoint=None, **options):
    """Forward and backward of emulated `moe_ffn_ep` on the nvlink transport, y returned as a training step
    uses it; `checkpoint`: None, or the policy of a jax.checkpoint around the layer ("none": no policy)."""
    per_shard = functools.partial(
        jmm.moe_ffn_ep, axis_name="expert", transport=jmm.NvlinkTransport(stand_in_workspace(RANKS)), **options
    )

    def step(x, weights, ids, w_gate_up, w_down):
        layer = jax.vmap(per_shard, axis_name="expert")
        forward = lambda a, b, c, d: layer(a, b, ids, c, d)  # noqa: E731
        if checkpoint is not None:
            forward = jax.checkpoint(forward, policy=None if checkpoint == "none" else checkpoint)
        y, vjp = jax.vjp(forward, x, weights, w_gate_up, w_down)
        return y, vjp(y)

    return step


@pytest.mark.parametrize(
    "capacity_factor, blocks",
    [
        (None, "1x8"),  # dropless: x itself is every destination's block
        (0.5, "2x4"),  # C = 4 < T: compacted send blocks
    ],
)
def test_moe_ffn_ep_lowers_to_the_fused_calls(cuda_lowering, capacity_factor, blocks):
    """`moe_ffn_ep`'s nvlink path, bf16 on the CUDA implementation: one call of each fused target (gate_up and
    down forward, backward), the plain exchange only for the ids and weights out and the weights' cotangent back
    (3 exchanges), no moe_ffn call; the fused calls take x as their one block ([1, T, H]) and return y likewise
    when every token has a slot, else [ep, C, H] blocks; with their operands, results, attributes, workspace
    sizes and the backward's alias."""
    text = lower_for_cuda(ep_step(capacity_factor=capacity_factor), *EP_SHAPES)
    for target in NVLINK_CALLS:
        assert len(custom_call_types(text, target)) == 1, target
    assert len(custom_call_types(text, "jmm_cuda_nvlink_exchange")) == 3
    for target in ("jmm_cuda_moe_gate_up", "jmm_cuda_moe_down", "jmm_cuda_moe_backward"):
        assert not custom_call_types(text, target), target
    local = EXPERTS // RANKS
    capacity = TOKENS if capacity_factor is None else 4
    rows, pairs, groups = RANKS * capacity, RANKS * capacity * TOP_K, local * RANKS
    r = f"{RANKS}x"
    [(operands, results)] = custom_call_types(text, "jmm_cuda_nvlink_moe_gate_up")
    assert operands == [
        f"{r}{blocks}x{HIDDEN}xbf16",
        f"{r}{local}x{HIDDEN}x{2 * INTER}xbf16",
        f"{r}{pairs}xi32",
        f"{r}{groups + 1}xi32",
    ]
    assert results == [
        f"{r}{RANKS}x{capacity}x{HIDDEN}xbf16",
        f"{r}{pairs}x{2 * INTER}xbf16",
        f"{r}{FUSED_WORKSPACE_BYTES}xui8",
    ]
    [(operands, results)] = custom_call_types(text, "jmm_cuda_nvlink_moe_down")
    assert operands == [
        f"{r}{pairs}x{2 * INTER}xbf16",
        f"{r}{rows}x{TOP_K}xf32",
        f"{r}{local}x{INTER}x{HIDDEN}xbf16",
        f"{r}{pairs}xi32",
        f"{r}{groups + 1}xi32",
        f"{r}{local + 1}xi32",
    ]
    assert results == [f"{r}{blocks}x{HIDDEN}xbf16", f"{r}{FUSED_WORKSPACE_BYTES}xui8"]
    [(operands, results)] = custom_call_types(text, "jmm_cuda_nvlink_moe_backward")
    assert operands[:2] == [f"{r}{blocks}x{HIDDEN}xbf16", f"{r}{RANKS}x{capacity}x{HIDDEN}xbf16"]
    assert results[0] == f"{r}{blocks}x{HIDDEN}xbf16" and results[-1] == f"{r}{FUSED_WORKSPACE_BYTES}xui8"
    assert results[4] == f"{r}{pairs}x{2 * INTER}xbf16"  # dz, written over the saved gate_up (operand 5)
    [backward] = call_lines(text, "jmm_cuda_nvlink_moe_backward")
    assert (
        "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [4], operand_index = 5"
        in backward
    )
    assert dict(_targets.NVLINK_MOE_BACKWARD.aliases) == {5: 4}
    # The workspace id is every fused call's attribute; the backward's row GEMMs take the heuristic's tiles.
    for target in NVLINK_CALLS:
        [line] = call_lines(text, target)
        assert "workspace = 3 : i64" in line, line
    tiles = GemmConfigOf(capacity)
    assert f"bwd_down_tiles = {int(tiles.bwd_down)} : i64" in backward
    assert f"bwd_gate_up_tiles = {int(tiles.bwd_gate_up)} : i64" in backward
    sizes = (rows, TOP_K, HIDDEN, INTER)
    assert ("jmm_cuda_nvlink_moe_gate_up", *sizes, groups) in cuda_lowering
    assert ("jmm_cuda_nvlink_moe_down", *sizes, groups) in cuda_lowering
    assert ("jmm_cuda_nvlink_moe_backward", *sizes, local) in cuda_lowering
    # The fine layout: one moe_layout over E_local * ep keys (per shard: vmap runs it sequentially).
    assert [call[1][2] for call in custom_call_types(text, "jmm_cuda_moe_layout")] == [f"{groups + 1}xi32"]


def GemmConfigOf(capacity):  # noqa: N802 - reads as the config of the received problem
    return jmm.GemmConfig.for_problem(RANKS * capacity, TOP_K, HIDDEN, INTER, EXPERTS // RANKS)


def nvlink_call_counts(text: str) -> dict[str, int]:
    return {
        t.removeprefix("jmm_cuda_"): len(custom_call_types(text, t))
        for t in (*NVLINK_CALLS, "jmm_cuda_nvlink_exchange", "jmm_cuda_moe_layout")
    }


def test_under_checkpoint_saving_the_named_residuals_nothing_is_recomputed(cuda_lowering):
    """jax.checkpoint with save_only_these_names("moe_layout", "moe_gate_up", "moe_rows"): the lowered program
    runs each nvlink call once (nothing of the exchanges or the experts recomputed), as without jax.checkpoint;
    with no policy the backward's recomputation runs the exchanges of the ids and weights, the layout and the
    gate_up call again, never the down call. (tests/test_nvlink_gpu.py counts the calls again in the program
    lowered and compiled on a GPU, and compares the gradients.)"""
    plain = nvlink_call_counts(lower_for_cuda(ep_step(), *EP_SHAPES))
    assert plain == {
        "nvlink_moe_gate_up": 1,
        "nvlink_moe_down": 1,
        "nvlink_moe_backward": 1,
        "nvlink_exchange": 3,
        "moe_layout": 1,
    }
    policy = jax.checkpoint_policies.save_only_these_names("moe_layout", "moe_gate_up", "moe_rows")
    assert nvlink_call_counts(lower_for_cuda(ep_step(checkpoint=policy), *EP_SHAPES)) == plain
    recomputed = nvlink_call_counts(lower_for_cuda(ep_step(checkpoint="none"), *EP_SHAPES))
    assert recomputed == {
        "nvlink_moe_gate_up": 2,
        "nvlink_moe_down": 1,
        "nvlink_moe_backward": 1,
        "nvlink_exchange": 5,
        "moe_layout": 2,
    }


@pytest.mark.parametrize("hidden", [HIDDEN, 136])
def test_the_fp8_recipe_lowers_to_plain_exchanges_of_quantised_rows(cuda_lowering, monkeypatch, hidden):
    """With recipe="fp8_blockwise" no fused call: the plain exchange moves the ids and weights, the rows as H bytes of
    e4m3 values and their scales (one per 128 values, H padded), and the bf16 results back; the backward moves the
    results' cotangent out, the rows' gradient and the weights' cotangent back (8 exchanges); the recipe's GEMMs
    run on the received rows."""
    monkeypatch.setattr(fp8, "check_fp8_tensor_cores", lambda: None)  # no GPU here to ask
    shapes = list(EP_SHAPES)
    shapes[0] = ((RANKS, TOKENS, hidden), jnp.bfloat16)
    shapes[3] = ((RANKS, EXPERTS // RANKS, hidden, 2 * INTER), jnp.bfloat16)
    shapes[4] = ((RANKS, EXPERTS // RANKS, INTER, hidden), jnp.bfloat16)
    text = lower_for_cuda(ep_step(recipe="fp8_blockwise"), *shapes)
    for target in NVLINK_CALLS:
        assert not custom_call_types(text, target), target
    exchanged = [operands[0] for operands, _ in custom_call_types(text, "jmm_cuda_nvlink_exchange")]
    r, rows = f"{RANKS}x{RANKS}x", TOKENS
    assert sorted(exchanged) == sorted(
        [
            f"{r}{rows}x{TOP_K}xi32",  # ids
            f"{r}{rows}x{TOP_K}xf32",  # weights
            f"{r}{rows}x{hidden}xui8",  # q(x)'s values
            f"{r}{rows}x{-(-hidden // 128)}xf32",  # their scales
            f"{r}{rows}x{hidden}xbf16",  # the results back
            f"{r}{rows}x{hidden}xbf16",  # their cotangent out
            f"{r}{rows}x{hidden}xbf16",  # the rows' gradient back
            f"{r}{rows}x{TOP_K}xf32",  # the weights' cotangent back
        ]
    )
    assert len(custom_call_types(text, "jmm_cuda_fp8_rows_gemm")) == 4
    assert len(custom_call_types(text, "jmm_cuda_fp8_weight_gemm")) == 2


def test_every_kernel_file_registers_its_module():
    """The nvlink workspace loads the kernels of the modules registered through kernel_module.cuh; a .cu file
    that does not include it would have its kernels loaded at their first launch, possibly while a peer GPU spins
    (tests/test_nvlink_gpu.py::test_workspace_loads_every_kernel_of_the_library checks the loading itself)."""
    kernel_files = sorted([*(ROOT / "cuda" / "kernels").glob("*.cu"), *(ROOT / "cuda" / "nvlink").glob("*.cu")])
    assert kernel_files
    missing = [f.name for f in kernel_files if not re.search(r'#include "[\w/]*kernel_module\.cuh"', f.read_text())]
    assert missing == []
