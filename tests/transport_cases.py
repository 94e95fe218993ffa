"""The test base every transport of `moe_ffn_ep` subclasses (tests/test_ep.py: "xla", and "ragged" with its
collective emulated, on 8 host CPU devices; tests/test_nvlink_gpu.py: the nvlink transport on shards emulated on
one GPU). Each case draws a fresh problem, its tokens split over the devices and its experts over the expert
axis, and runs `moe_ffn_ep` forward and every gradient with its stats:
- the program takes the transport's own path (`check_program`);
- twice bit for bit alike, and bit for bit the "xla" transport on the same shards (for the other transports);
- the stats equal an independent model of the capacity rule (`expected_capacity`), and the output and gradients
  the float32 reference on the gathered problem with the dropped pairs' ids set to -1 (none when dropless).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from moe_cases import OUTPUT_NAMES, TOLERANCE, Case, make_problem, reference_value_and_grads, rel_error

from jax_megamoe.parallel import moe_ffn_ep

# Dropless routings every transport runs: all_to_one puts every pair on the last shard's experts; empty_experts
# leaves experts and whole shards without pairs.
ROUTINGS = ("uniform", "zipf", "all_to_one", "empty_experts")


@dataclasses.dataclass(frozen=True)
class EpCase:
    """`shards` on the expert axis (times `data` on a data axis), a routing pattern (tests/moe_cases.py), a
    capacity factor (None: dropless), and the experts and top-k where they differ from the subclass's `size`."""

    shards: int
    routing: str = "uniform"
    capacity_factor: float | None = None
    data: int = 1
    experts: int | None = None
    top_k: int | None = None

    @property
    def devices(self) -> int:
        return self.data * self.shards

    def problem(self, size: Case) -> Case:
        """The gathered problem: `size.tokens` tokens per device."""
        experts, top_k = self.experts or size.experts, self.top_k or size.top_k
        return Case(size.tokens * self.devices, size.hidden, size.inter, experts, top_k, self.routing)

    def __str__(self) -> str:
        parts = [f"data{self.data}xep{self.shards}" if self.data > 1 else f"ep{self.shards}", self.routing]
        if self.capacity_factor is not None:
            parts.append(f"cf{self.capacity_factor:g}")
        if self.experts is not None:
            parts.append(f"E{self.experts}")
        if self.top_k is not None:
            parts.append(f"K{self.top_k}")
        return "-".join(parts)


def expected_capacity(ids: np.ndarray, case: EpCase, experts: int, pair_capacity: int):
    """Independent model of the capacity rule: `(kept [T, K] bool, counts [devices, E_local], dropped [devices])`.

    Device d holds token block d; each device (a source) sends at most `pair_capacity` pairs to each expert shard
    of its own row of the mesh, in (token, k) order. The receiver of source (row, col) for expert shard e is
    (row, e), and counts what it computes and what was dropped on the way to it."""
    local = experts // case.shards
    blocks = ids.reshape(case.devices, -1, ids.shape[1])
    kept = np.zeros(blocks.shape, bool)
    counts = np.zeros((case.devices, local), np.int64)
    dropped = np.zeros(case.devices, np.int64)
    for source in range(case.devices):
        row = source // case.shards
        sent = np.zeros(case.shards, np.int64)
        for t, k in np.ndindex(blocks.shape[1:]):
            expert = blocks[source, t, k]
            if not 0 <= expert < experts:
                continue
            dest = expert // local
            receiver = row * case.shards + dest
            if sent[dest] < pair_capacity:
                kept[source, t, k] = True
                counts[receiver, expert % local] += 1
            else:
                dropped[receiver] += 1
            sent[dest] += 1
    return kept.reshape(ids.shape), counts, dropped


def pair_capacity(problem: Case, case: EpCase) -> int:
    """Pairs each source may send each expert shard: all of its own, or the capacity factor's balanced share."""
    own = problem.tokens // case.devices * problem.top_k
    return own if case.capacity_factor is None else min(own, math.ceil(case.capacity_factor * own / case.shards))


def value_grads_and_stats(layer, args, dy):
    """`((y, dx, d_weights, d_w_gate_up, d_w_down), stats)` of `layer(*args) -> (y, *stats)` for the cotangent
    `dy` (cast to y's dtype)."""
    x, weights, ids, w_gate_up, w_down = args

    def forward(a, w, g, d):
        y, *stats = layer(a, w, ids, g, d)
        return y, tuple(stats)

    y, vjp, stats = jax.vjp(forward, x, weights, w_gate_up, w_down, has_aux=True)
    return (y, *vjp(dy.astype(y.dtype))), stats


def assert_bitwise_equal(first, second) -> None:
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(first), jax.tree.leaves(second), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


# TransportBase.compiled's functions, by (the subclass's `sharded`, transport, case without its routing).
_COMPILED: dict[tuple, Callable] = {}


class TransportBase:
    """Subclasses set `transport` (or open one in `opened`), `size` (tokens per device, H, I, E, K), `dtype` and
    the `cases` they run; `sharded` maps a shard's function onto the gathered problem (default: shard_map over the
    first devices of JAX's default backend)."""

    transport: object
    size: Case
    dtype = jnp.float32
    cases: tuple[EpCase, ...]
    compared_with_xla = True  # False on "xla" itself, the transport the others are held to

    @contextlib.contextmanager
    def opened(self, case: EpCase, problem: Case) -> Iterator[object]:
        """The `transport` argument for `case`, usable while the context is open."""
        yield self.transport

    def sharded(self, per_shard: Callable, case: EpCase) -> Callable:
        """`per_shard` (one shard's arrays -> a tuple of arrays split along their first axis) as a function of the
        gathered arrays: tokens over ("data", "expert"), experts over "expert"."""
        mesh = Mesh(np.array(jax.devices()[: case.devices]).reshape(case.data, case.shards), ("data", "expert"))
        tokens, experts = P(("data", "expert")), P("expert")
        return jax.shard_map(per_shard, mesh=mesh, in_specs=(tokens,) * 3 + (experts,) * 2, out_specs=tokens)

    def check_program(self, lowered: jax.stages.Lowered, case: EpCase) -> None:
        """Checks the lowered program of `case` for the transport's own path."""

    def compiled(self, transport, case: EpCase):
        """Jitted `value_grads_and_stats` of `moe_ffn_ep` on `transport` over the shards of `case`; the stats per
        device: the pairs each local expert computed, the pairs received, the pairs dropped. One function for the
        cases that differ only in their routing, whose problems share their shapes: it compiles once."""
        key = (type(self).sharded, transport, dataclasses.replace(case, routing=""))
        if key not in _COMPILED:
            _COMPILED[key] = self._jitted(transport, case)
        return _COMPILED[key]

    def _jitted(self, transport, case: EpCase):
        def per_shard(*args):
            y, stats = moe_ffn_ep(*args, transport=transport, capacity_factor=case.capacity_factor, return_stats=True)
            return y, stats.expert_counts, stats.pairs_received[None], stats.pairs_dropped[None]

        layer = self.sharded(per_shard, case)
        return jax.jit(lambda args, dy: value_grads_and_stats(layer, args, dy))

    def test_matches_the_reference_and_counts_exactly(self, case_index):
        case = self.cases[case_index]
        problem = case.problem(self.size)
        args, dy = make_problem(problem, self.dtype, seed=("transport", type(self).__name__, str(case)))
        with self.opened(case, problem) as transport:
            fn = self.compiled(transport, case)
            self.check_program(fn.lower(args, dy), case)
            first, second = (jax.block_until_ready(fn(args, dy)) for _ in range(2))
        assert_bitwise_equal(first, second)
        if self.compared_with_xla:
            assert_bitwise_equal(first, self.compiled("xla", case)(args, dy))

        outputs, (counts, received, dropped) = first
        kept, want_counts, want_dropped = expected_capacity(
            np.asarray(args[2]), case, problem.experts, pair_capacity(problem, case)
        )
        np.testing.assert_array_equal(np.asarray(counts).reshape(want_counts.shape), want_counts)
        np.testing.assert_array_equal(np.asarray(received), want_counts.sum(1))
        np.testing.assert_array_equal(np.asarray(dropped), want_dropped)
        # Dropped pairs behave as out-of-range ids: zero output, zero gradient.
        x, weights, ids, w_gate_up, w_down = args
        expected = reference_value_and_grads((x, weights, jnp.where(kept, ids, -1), w_gate_up, w_down), dy)
        tolerance = TOLERANCE[jnp.dtype(self.dtype).name]
        for name, got, want in zip(OUTPUT_NAMES, outputs, expected, strict=True):
            assert got.shape == want.shape, name
            assert rel_error(got, want) <= tolerance, f"{name}: relative error {rel_error(got, want):.2e}"


def parametrize_cases(metafunc):
    """`pytest_generate_tests` of the modules with subclasses: `case_index` over the class's cases."""
    if "case_index" in metafunc.fixturenames:
        cases = metafunc.cls.cases
        metafunc.parametrize("case_index", range(len(cases)), ids=[str(c) for c in cases])
