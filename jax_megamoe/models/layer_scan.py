"""A scan over stacked layers whose backward keeps each layer's residuals without zero-filling their stacks.

`jax.lax.scan` under `jax.grad` writes every value the backward needs into a stacked buffer, and XLA first
fills each stack with zeros (JAX's scan initialises its stacked outputs with a broadcast zero): as many bytes of
writes per training step as every layer's stacked residuals hold, which nothing reads. `scan` below
computes the same thing under a `jax.custom_vjp`: its forward runs each layer under `jax.vjp` and writes the
residuals of that vjp (the leaves of the VJP pytree) into stacks made by `jax.lax.empty` (uninitialised
memory on GPUs), and its backward runs the layers' vjps in reverse from slices of those stacks. A residual
that is one of the layer's inputs (a parameter slice, a constant) is not stacked: the backward slices it
again. Nor is a residual that is another one seen through reshapes or optimisation barriers (attention's
output and its [B, S, N*D] view for the output projection, an array and the copy of it that a kernel keeps
behind a barrier): the backward rebuilds it from the other's slice, where XLA, which aliases such views in an
unrolled program, would copy each into a stack of its own. What the layer saves is unchanged (its remat
policies and custom_vjps decide), so values and gradients equal `jax.lax.scan`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Where a residual of a layer's vjp comes from in the backward: its stack, the layer's parameter slice, the
# constants, or another residual (reshaped to the residual's shape).
_STACKED, _PARAM, _CONST, _VIEW = 0, 1, 2, 3

# Primitives whose output is their input's values in another shape: a residual made by a chain of them from
# another residual is rebuilt from it.
_RESHAPES = ("reshape", "squeeze", "expand_dims")


def _uninitialized(shape, dtype) -> jax.Array:
    # XLA's SPMD partitioner has no rule for the AllocateBuffer call behind `lax.empty` (it would replicate the
    # stack), so with several devices the stacks are zero-filled as `jax.lax.scan`'s are.
    if jax.device_count() > 1:
        return jnp.zeros(shape, dtype)
    return jax.lax.empty(shape, dtype)


def _identity(tree):
    return tree


def _index(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _write(stacks, values, i):
    return jax.tree.map(lambda s, v: jax.lax.dynamic_update_index_in_dim(s, v, i, 0), stacks, values)


def _views(jaxpr) -> dict[int, tuple[int, tuple[int, ...]]]:
    """{k: (j, shape)}: output k of `jaxpr` (of that shape) is output j's values, through reshapes and
    optimisation barriers only (j the deepest such output along the chain, so never itself a view)."""
    producer = {id(v): eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    position: dict[int, int] = {}
    for j, v in enumerate(jaxpr.outvars):
        position.setdefault(id(v), j)
    views = {}
    for k, v in enumerate(jaxpr.outvars):
        root = None
        while (eqn := producer.get(id(v))) is not None:
            if eqn.primitive.name == "optimization_barrier":
                v = eqn.invars[[id(o) for o in eqn.outvars].index(id(v))]
            elif eqn.primitive.name in _RESHAPES and eqn.params.get("dimensions") is None:
                v = eqn.invars[0]
            else:
                break
            if id(v) in position:  # another output: the chain has no cycles
                root = position[id(v)]
        if root is not None:
            views[k] = (root, jaxpr.outvars[k].aval.shape)
    return views


def _stacks_like(tree, length: int):
    return jax.tree.map(lambda a: _uninitialized((length, *a.shape), a.dtype), tree)


def _zero_cotangent(shape, dtype):
    if dtype != jax.dtypes.float0 and jnp.issubdtype(dtype, jnp.inexact):
        return jnp.zeros(shape, dtype)
    return np.zeros(shape, jax.dtypes.float0)


def _add_cotangents(total, ct):
    return jax.tree.map(lambda a, b: a if a.dtype == jax.dtypes.float0 else a + b, total, ct)


def scan(
    fn: Callable[[Any, Any, Any], tuple[Any, Any]],
    stacked: Any,
    carry: Any,
    consts: Any,
    prepare: Callable[[Any], Any] | None = None,
) -> tuple[Any, Any]:
    """`jax.lax.scan(lambda c, p: fn(prepare(p), c, consts), carry, stacked)`, differentiable in all three
    arguments.

    `fn(params, carry, consts) -> (carry, y)` is one layer: `params` a slice of `stacked` (a pytree of arrays
    with a leading layer axis), `y` stacked over the layers in the result. `fn` must be pure (everything it
    reads passed in) and its parameters floating point. `prepare` (default: none) maps parameters leaf by leaf
    and elementwise, e.g. a cast to the compute dtype: it runs on each layer's slice in the forward and again in
    the backward, so no prepared copy of every layer is kept, and the gradients stack in its output's dtype
    and pass through its transpose once, after the loop (float32 parameters cast to bf16 stack bf16
    gradients).
    """
    if prepare is None:
        prepare = _identity
    lengths = {leaf.shape[0] for leaf in jax.tree.leaves(stacked)}
    if len(lengths) != 1:
        raise ValueError(f"scan needs stacked parameters with one leading length, got {sorted(lengths)}")
    (length,) = lengths

    @jax.custom_vjp
    def run(stacked, carry, consts):
        return jax.lax.scan(lambda c, p: fn(prepare(p), c, consts), carry, stacked)

    # The VJP pytree's structure, and where each of its leaves comes from, as traced in the forward's loop
    # body: the backward rebuilds each layer's vjp from them.
    traced: dict[str, Any] = {}

    def classify(leaves, params, consts_, views):
        params_ids = {id(p): k for k, p in enumerate(jax.tree.leaves(params))}
        consts_ids = {id(c): k for k, c in enumerate(jax.tree.leaves(consts_))}
        kept_ids: dict[int, int] = {}
        sources: list[tuple[int, Any]] = []
        kept: list[Any] = []
        for position, leaf in enumerate(leaves):
            if id(leaf) in params_ids:
                sources.append((_PARAM, params_ids[id(leaf)]))
            elif id(leaf) in consts_ids:
                sources.append((_CONST, consts_ids[id(leaf)]))
            elif position in views:
                sources.append((_VIEW, views[position]))
            else:
                if id(leaf) not in kept_ids:
                    kept_ids[id(leaf)] = len(kept)
                    kept.append(leaf)
                sources.append((_STACKED, kept_ids[id(leaf)]))
        return tuple(sources), kept

    def layer_vjp(params, c, consts_, views):
        out, vjp = jax.vjp(fn, params, c, consts_)
        leaves, treedef = jax.tree.flatten(vjp)
        sources, kept = classify(leaves, params, consts_, views)
        return out, kept, treedef, sources

    def run_fwd(stacked, carry, consts):
        params0 = prepare(_index(stacked, 0))
        residuals = jax.make_jaxpr(lambda *args: jax.tree.leaves(jax.vjp(fn, *args)[1]))(params0, carry, consts)
        views = _views(residuals.jaxpr)
        shapes = {}

        def probe(params, c, consts_):
            out, kept, _, sources = layer_vjp(params, c, consts_, views)
            shapes["sources"] = sources
            return out, kept

        (_, y_shape), res_shapes = jax.eval_shape(probe, params0, carry, consts)
        res_stacks = _stacks_like(res_shapes, length)
        ys = _stacks_like(y_shape, length)

        def body(i, state):
            c, ys, res_stacks = state
            (c, y), kept, treedef, sources = layer_vjp(prepare(_index(stacked, i)), c, consts, views)
            if sources != shapes["sources"]:
                raise AssertionError("the layer's vjp residuals differ between two traces of the layer")
            traced["treedef"], traced["sources"] = treedef, sources
            return c, _write(ys, y, i), _write(res_stacks, kept, i)

        carry, ys, res_stacks = jax.lax.fori_loop(0, length, body, (carry, ys, res_stacks))
        return (carry, ys), (stacked, consts, res_stacks)

    def run_bwd(res, cts):
        stacked, consts, res_stacks = res
        d_carry, d_ys = cts
        treedef, sources = traced["treedef"], traced["sources"]
        consts_leaves = jax.tree.leaves(consts)

        def body(j, state):
            i = length - 1 - j
            d_c, d_stacked, d_consts = state
            params = prepare(_index(stacked, i))
            params_leaves = jax.tree.leaves(params)
            kept = _index(res_stacks, i)
            from_ = {_STACKED: kept, _PARAM: params_leaves, _CONST: consts_leaves}
            leaves = [None if kind == _VIEW else from_[kind][k] for kind, k in sources]
            for position, (kind, k) in enumerate(sources):
                if kind == _VIEW:
                    root, shape = k
                    leaves[position] = jnp.reshape(leaves[root], shape)
            d_y = jax.tree.map(
                lambda d: (
                    _zero_cotangent(d.shape[1:], d.dtype)
                    if d.dtype == jax.dtypes.float0
                    else jax.lax.dynamic_index_in_dim(d, i, keepdims=False)
                ),
                d_ys,
            )
            d_params, d_c, d_k = jax.tree.unflatten(treedef, leaves)((d_c, d_y))
            return d_c, _write(d_stacked, d_params, i), _add_cotangents(d_consts, d_k)

        d_prepared = _stacks_like(jax.eval_shape(prepare, _index(stacked, 0)), length)
        d_consts = jax.tree.map(lambda a: _zero_cotangent(a.shape, a.dtype), consts)
        d_carry, d_prepared, d_consts = jax.lax.fori_loop(0, length, body, (d_carry, d_prepared, d_consts))
        (d_stacked,) = jax.vjp(prepare, stacked)[1](d_prepared)
        return d_stacked, d_carry, d_consts

    run.defvjp(run_fwd, run_bwd)
    return run(stacked, carry, consts)
