"""Generation for the Qwen3-MoE model: prefill, then a decode loop on the device over a preallocated KV cache,
on the model's own layers and kernels, so the sampler's log-probabilities are the trainer's.

Prompts are right-padded to a bucket (a power of two, at least `MIN_PROMPT_BUCKET`) and keep their own positions:
row b's prompt fills cache slots 0..len_b-1 and its t-th new token goes to slot len_b + t. The whole run, prefill
and the `lax.while_loop` of decode steps, is one compiled program per model, batch size, prompt bucket,
`max_new_tokens` and sampling settings (`compiled_programs` counts them). docs/models.md, "Generation".
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_megamoe.models.kv_cache import KVCache
from jax_megamoe.models.qwen3_moe_config import Qwen3MoeConfig
from jax_megamoe.models.sampling import check_sampling, sample_logits, token_logprobs
from jax_megamoe.nn import active_mesh


class CausalLM(Protocol):
    """What generation needs of a model (`Qwen3MoeForCausalLM` has it); named here so that this module does not
    import the model module that re-exports it."""

    config: Qwen3MoeConfig

    def init_cache(self, batch: int, length: int, *, record_routing: bool = False) -> KVCache: ...

    def prefill(self, input_ids: jax.Array, lengths: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]: ...

    def decode(self, input_ids: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]: ...

    def logits(self, hidden: jax.Array) -> jax.Array: ...

    def compute_form(self) -> CausalLM: ...


MIN_PROMPT_BUCKET = 16


class Generation(NamedTuple):
    """What `generate` returns (device arrays)."""

    tokens: jax.Array  # [B, max_new_tokens] int32; pad_token_id once the row has stopped
    logprobs: jax.Array  # [B, max_new_tokens] float32: log_softmax(logits) of each token at temperature 1; 0 after
    lengths: jax.Array  # [B] int32: tokens generated per row, its eos token counted
    # With return_routing: [B, positions, L_moe, K], the experts each sparse layer chose for the token at each
    # position (prompt then completion), -1 where no token was fed (padding, the last token); else None.
    routing: jax.Array | None = None


class GenerationPlan(NamedTuple):
    """The shapes `generate` runs with: the prompts padded to `prompt_bucket`, a KV cache of `cache_length` slots
    per row taking `cache_bytes` (all devices together)."""

    prompt_bucket: int
    cache_length: int
    cache_bytes: int


def prompt_bucket(longest_prompt: int) -> int:
    """The padded prompt length: the next power of two at or above `longest_prompt`, at least
    `MIN_PROMPT_BUCKET`, so that batches of any prompt lengths compile a few programs."""
    return max(MIN_PROMPT_BUCKET, 1 << (longest_prompt - 1).bit_length())


def generation_plan(model: CausalLM, batch: int, longest_prompt: int, max_new_tokens: int) -> GenerationPlan:
    """The shapes of a `generate` call with `batch` prompts, the longest `longest_prompt` tokens."""
    bucket = prompt_bucket(longest_prompt)
    length = bucket + max_new_tokens
    return GenerationPlan(bucket, length, jax.eval_shape(lambda: model.init_cache(batch, length)).nbytes)


_programs_compiled = 0


def compiled_programs() -> int:
    """How many generation programs this process has compiled (one per model structure, batch size, prompt
    bucket, `max_new_tokens`, sampling settings and input shardings)."""
    return _programs_compiled


@dataclasses.dataclass(frozen=True)
class _Settings:
    rows: int  # sequences decoded at once (the KV cache's batch)
    continuous: bool  # fewer rows than prompts: rows take new prompts as theirs end
    width: int  # the results' width: the largest max_new_tokens
    temperature: float
    top_k: int | None
    top_p: float | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    return_routing: bool


class _Results(NamedTuple):
    """Per prompt: what `Generation` returns, filled as the rows serving the prompts emit tokens."""

    tokens: jax.Array  # [N, width] int32
    logprobs: jax.Array  # [N, width] float32
    lengths: jax.Array  # [N] int32
    routing: jax.Array | None  # [N, bucket + width, L_moe, K], or None


class _Loop(NamedTuple):
    next_prompt: jax.Array  # [] int32: the first prompt no row has taken yet
    serving: _Serving  # [R] each: what each row serves
    cache: KVCache
    results: _Results


def _rows(x: jax.Array, axis: int = 0) -> jax.Array:
    """`x` with its rows (dimension `axis`) split over every axis of the active mesh, as the MoE layers split
    the tokens; unchanged without one."""
    mesh = active_mesh()
    if mesh is None:
        return x
    spec: list[Any] = [None] * x.ndim
    spec[axis] = tuple(mesh.axis_names)
    return jax.lax.with_sharding_constraint(x, P(*spec))


class _Inputs(NamedTuple):
    """What every row draws its prompts from: the padded prompts `[N, bucket]`, their lengths and token budgets
    `[N]`, each prompt's sampling key (or None: greedy), and the sparse layers' indices (the routing record's)."""

    prompts: jax.Array
    lengths: jax.Array
    budgets: jax.Array
    keys: jax.Array | None
    sparse_layers: np.ndarray


class _Serving(NamedTuple):
    """What some rows serve: per row, the prompt (-1: none), the tokens emitted for it, the last one."""

    prompt: jax.Array
    emitted: jax.Array
    token: jax.Array


@jax.named_scope("sampling")
def _emit(
    results: _Results,
    serving: _Serving,
    cache: KVCache,
    logits: jax.Array,
    active: jax.Array,
    inputs: _Inputs,
    settings: _Settings,
) -> tuple[_Results, _Serving]:
    """The next token of every `active` row (of `serving` and `cache`, batch R) chosen from `logits [R, V]` and
    written to its prompt's results; a row whose prompt ends (an eos token, or its budget reached) stops serving
    it, its routing record copied to the prompt."""
    logits = logits.astype(jnp.float32)
    sample = functools.partial(
        sample_logits, temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p
    )
    served = jnp.maximum(serving.prompt, 0)
    if inputs.keys is None:
        token = sample(None, logits)
    else:  # each prompt's own key, folded with the token's index: which row serves the prompt does not matter
        step_keys = jax.vmap(jax.random.fold_in)(inputs.keys[served], serving.emitted)
        token = jax.vmap(lambda key, row: sample(key, row[None])[0])(step_keys, logits)
    logprob = token_logprobs(logits, token)
    count = serving.emitted + active
    ends = count >= inputs.budgets[served]
    for eos in settings.eos_token_ids:
        ends |= token == eos
    ends &= active
    if settings.continuous:  # scattered to the prompts the rows serve (out of bounds: dropped)
        nowhere = results.lengths.shape[0]
        target = jnp.where(active, serving.prompt, nowhere)
        results = results._replace(
            tokens=results.tokens.at[target, serving.emitted].set(token, mode="drop"),
            logprobs=results.logprobs.at[target, serving.emitted].set(logprob, mode="drop"),
            lengths=results.lengths.at[target].set(count, mode="drop"),
        )
        if results.routing is not None:
            assert cache.routing is not None  # the results keep a record only where the cache does
            record = _fed_routing(cache.routing, inputs, served, count)
            ended = jnp.where(ends, serving.prompt, nowhere)
            results = results._replace(routing=results.routing.at[ended].set(record, mode="drop"))
    else:  # row r serves prompt r: a masked write, split over the devices with the rows
        written = active[:, None] & (jnp.arange(results.tokens.shape[1]) == serving.emitted[:, None])
        results = results._replace(
            tokens=jnp.where(written, token[:, None], results.tokens),
            logprobs=jnp.where(written, logprob[:, None], results.logprobs),
            lengths=jnp.where(active, count, results.lengths),
        )
    return results, _Serving(jnp.where(ends, -1, serving.prompt), count, jnp.where(active, token, serving.token))


def _fed_routing(recorded: jax.Array, inputs: _Inputs, served: jax.Array, count: jax.Array) -> jax.Array:
    """The rows' routing record `[layers, R, S, K]` as `[R, S, L_moe, K]` (the sparse layers), -1 at every slot
    whose token the row did not feed for its prompt: past the prompt and its generated tokens but the last one,
    which is never fed (the prompt's padding or an earlier prompt wrote slots there)."""
    record = jnp.moveaxis(recorded[inputs.sparse_layers], 0, 2)
    fed = jnp.arange(record.shape[1])[None] < (inputs.lengths[served] + count - 1)[:, None]
    return jnp.where(fed[:, :, None, None], record, jnp.asarray(-1, record.dtype))


def _map_batch(fn, cache: KVCache, *others: KVCache) -> KVCache:
    """`fn(field, *the others' same field, batch axis)` for every field of `cache` (the routing record where kept)."""

    def field(name: str, axis: int):
        value = getattr(cache, name)
        return None if value is None else fn(value, *(getattr(other, name) for other in others), axis)

    return KVCache(field("k", 1), field("v", 1), field("lengths", 0), field("routing", 1))


def _row_cache(cache: KVCache, row) -> KVCache:
    """Row `row` of the cache (a batch of one)."""
    return _map_batch(lambda a, axis: jax.lax.dynamic_slice_in_dim(a, row, 1, axis), cache)


def _with_row(cache: KVCache, row, part: KVCache) -> KVCache:
    """The cache with row `row` replaced by `part` (a batch of one)."""
    return _map_batch(lambda a, b, axis: jax.lax.dynamic_update_slice_in_dim(a, b, row, axis), cache, part)


def _run(graphdef, settings: _Settings, state, prompts, prompt_lengths, budgets, count, keys) -> Generation:
    global _programs_compiled
    _programs_compiled += 1  # once per trace: jit traces each program it compiles
    # Every parameter in its compute sharding once, before the loop, so no step gathers FSDP shards.
    model = nnx.merge(graphdef, state).compute_form()
    slots, bucket = prompts.shape  # `count` of the slots are prompts; the rest padding, never taken
    rows, width = settings.rows, settings.width
    inputs = _Inputs(prompts, prompt_lengths, budgets, keys, np.array(sorted(model.config.moe_layer_index())))
    cache = model.init_cache(rows, bucket + width, record_routing=settings.return_routing)
    cache = _map_batch(_rows, cache)
    routing = None
    if cache.routing is not None:
        routing = jnp.full((slots, bucket + width, len(inputs.sparse_layers), cache.routing.shape[-1]), -1,
                           cache.routing.dtype)  # fmt: skip
    results = _Results(
        tokens=jnp.full((slots, width), settings.pad_token_id, jnp.int32),
        logprobs=jnp.zeros((slots, width), jnp.float32),
        lengths=jnp.zeros((slots,), jnp.int32),
        routing=routing,
    )
    if not settings.continuous:
        results = results._replace(tokens=_rows(results.tokens), logprobs=_rows(results.logprobs),
                                   lengths=_rows(results.lengths))  # fmt: skip
    # The first `rows` prompts fill the rows in one batched prefill.
    hidden, cache = model.prefill(_rows(prompts[:rows]), _rows(prompt_lengths[:rows]), cache)
    last = jnp.take_along_axis(hidden, (prompt_lengths[:rows] - 1)[:, None, None], axis=1)[:, 0]
    first = _rows(jnp.arange(rows, dtype=jnp.int32))
    serving = _Serving(first, jnp.zeros_like(first), jnp.zeros_like(first))
    results, serving = _emit(results, serving, cache, model.logits(last), jnp.ones((rows,), bool), inputs, settings)
    loop = _Loop(jnp.asarray(rows, jnp.int32), serving, cache, results)

    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)

    def merged():
        # Modules of the loop body's own trace (flax does not let a transform inside update outer ones).
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

    def refill(loop: _Loop) -> _Loop:
        """The first row that serves no prompt takes the next one: the prompt prefilled into its cache row (the
        slots its earlier prompt wrote are overwritten before any query sees them) and its first token emitted."""
        model = merged()
        row, q = jnp.argmax(loop.serving.prompt < 0), loop.next_prompt
        length = jax.lax.dynamic_slice_in_dim(prompt_lengths, q, 1)
        ids = jax.lax.dynamic_slice_in_dim(prompts, q, 1)
        hidden, part = model.prefill(ids, length, _row_cache(loop.cache, row))
        last = jax.lax.dynamic_index_in_dim(hidden[0], length[0] - 1)
        one = _Serving(q[None], jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32))
        results, one = _emit(loop.results, one, part, model.logits(last), jnp.ones((1,), bool), inputs, settings)
        serving = jax.tree.map(lambda a, b: a.at[row].set(b[0]), loop.serving, one)
        return _Loop(q + 1, serving, _with_row(loop.cache, row, part), results)

    def refill_all(loop: _Loop) -> _Loop:
        if slots == rows:  # every prompt took a row at the start: none is left to take
            return loop

        def wanted(loop: _Loop) -> jax.Array:
            return jnp.any(loop.serving.prompt < 0) & (loop.next_prompt < count)

        return jax.lax.while_loop(wanted, refill, loop)

    @jax.named_scope("decode_step")  # the profiles' name for the loop body (benchmarks/profile_decode.py)
    def decode_step(loop: _Loop) -> _Loop:
        model = merged()
        hidden, cache = model.decode(loop.serving.token[:, None], loop.cache)
        active = loop.serving.prompt >= 0
        results, serving = _emit(
            loop.results, loop.serving, cache, model.logits(hidden[:, 0]), active, inputs, settings
        )
        return refill_all(_Loop(loop.next_prompt, serving, cache, results))

    loop = jax.lax.while_loop(lambda loop: jnp.any(loop.serving.prompt >= 0), decode_step, refill_all(loop))
    results = loop.results
    if results.routing is not None and not settings.continuous:  # each row's record is its prompt's
        assert loop.cache.routing is not None
        results = results._replace(routing=_fed_routing(loop.cache.routing, inputs, first, results.lengths))
    return Generation(*results)


_run_jit = jax.jit(_run, static_argnums=(0, 1))


def _int_list(value, name: str) -> list[int]:
    try:
        return [operator.index(v) for v in value]
    except TypeError:
        raise TypeError(f"{name} must hold integer token ids, got {value!r}") from None


def _prompt_batch(prompts, prompt_lengths, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`(ids [B, W] int32, lengths [B] int32)` from a list of token-id lists or a right-padded array."""
    if isinstance(prompts, Sequence) and not isinstance(prompts, str | bytes):
        if prompt_lengths is not None:
            raise ValueError("prompt_lengths goes with a right-padded prompts array; a list of prompts has its own")
        if not prompts:
            raise ValueError("prompts is empty; generate needs at least one prompt")
        rows = [_int_list(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        lengths = np.array([len(row) for row in rows], np.int32)
        ids = np.zeros((len(rows), max(lengths)), np.int32)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
    else:
        ids = np.asarray(prompts)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or ids.shape[0] == 0:
            raise ValueError(
                "prompts must be a list of token-id lists or a right-padded integer array [B, L] with B >= 1, "
                f"got {ids.dtype} {ids.shape}"
            )
        if prompt_lengths is None:
            lengths = np.full((ids.shape[0],), ids.shape[1], np.int32)
        else:
            lengths = np.asarray(prompt_lengths)
            if lengths.shape != (ids.shape[0],) or not np.issubdtype(lengths.dtype, np.integer):
                raise ValueError(
                    f"prompt_lengths must be integers of shape ({ids.shape[0]},) (one per prompt), "
                    f"got {lengths.dtype} {lengths.shape}"
                )
            if np.any(lengths > ids.shape[1]):
                raise ValueError(f"prompt_lengths {lengths.tolist()} exceed the prompts' width {ids.shape[1]}")
    empty = np.flatnonzero(lengths < 1)
    if empty.size:
        raise ValueError(f"prompt {int(empty[0])} is empty; every prompt needs at least one token")
    valid = np.arange(ids.shape[1])[None] < lengths[:, None]
    out_of_range = valid & ((ids < 0) | (ids >= vocab_size))
    if np.any(out_of_range):
        row, col = np.argwhere(out_of_range)[0]
        raise ValueError(f"prompt {row} holds token id {ids[row, col]} at {col}, outside [0, vocab_size={vocab_size})")
    return ids.astype(np.int32), lengths.astype(np.int32)


def _token_ids(value, name: str, vocab_size: int) -> tuple[int, ...]:
    values = (value,) if isinstance(value, int | np.integer) else value
    try:
        ids = tuple(operator.index(v) for v in values)
    except TypeError:
        raise TypeError(f"{name} must be an int or a list of ints, got {value!r}") from None
    bad = [v for v in ids if not 0 <= v < vocab_size]
    if bad:
        raise ValueError(f"{name} {bad} outside [0, vocab_size={vocab_size})")
    return ids


def _pad_id(value, vocab_size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"pad_token_id must be an int, got {value!r}")
    if not 0 <= value < vocab_size:
        raise ValueError(f"pad_token_id {value} outside [0, vocab_size={vocab_size})")
    return int(value)


def generate(
    model: CausalLM,
    prompts,
    *,
    max_new_tokens: int | Sequence[int],
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    key: jax.Array | None = None,
    prompt_lengths=None,
    return_routing: bool = False,
    rows: int | None = None,
) -> Generation:
    """Continues each prompt by up to `max_new_tokens` tokens: `Generation(tokens, logprobs, lengths)`, one row of
    each per prompt, in the prompts' order.

    Args:
      model: a `Qwen3MoeForCausalLM` (any `implementation`, `recipe`, `scan_layers`, `attention_impl`).
      prompts: a list of token-id lists (lengths may differ), or a right-padded integer array `[N, L]` with
        `prompt_lengths [N]` (default: every row L tokens).
      max_new_tokens: an int >= 1, or one per prompt (a budget each): the results' width is the largest; a
        prompt's length plus its budget is at most the config's `max_position_embeddings`.
      temperature: 0 is greedy (the most likely token, the lowest id among ties); above 0, tokens are drawn
        from `softmax(process_logits(logits))` with `key` (required then).
      top_k, top_p: the sampling filters of `jax_megamoe.models.sampling.process_logits`, transformers' order
        and ties (this top_k is not the config's experts per token).
      eos_token_id: an id or a list of ids; a prompt stops after emitting one (counted in its length).
      pad_token_id: the token after a prompt stops (default 0); its log-probs there are 0.
      key: a `jax.random.key`, from which prompt i takes `jax.random.fold_in(key, i)`, or an array of N keys, one
        per prompt; a prompt's t-th token is drawn with `fold_in(its key, t)`, so its tokens do not depend on the
        other prompts or on which row served it: generating it alone with its key gives the same tokens.
      return_routing: also return `Generation.routing [N, bucket + width, L_moe, K]`: the experts each sparse
        layer chose for the token at each position (prompt then completion, the layout of a training row;
        `bucket` is the prompts' padded width, `generation_plan`'s), -1 where nothing was fed (prompt padding,
        positions after a prompt's last generated token, and that token itself, which is never fed), in the
        narrowest integer type holding the expert ids (`qwen3_moe.routing_dtype`). Pass its first S positions
        as `routing=` to the model's forward over the same sequences to replay them. Without it nothing is
        recorded.
      rows: how many sequences decode at once, the KV cache's batch (default: every prompt). With fewer rows
        than prompts (continuous batching), a row whose prompt ends takes the next prompt inside the loop on the
        device (its cache row prefilled with it), so long-tailed completion lengths keep every row busy; each
        prompt's results are those of generating it alone (up to float rounding of the batched prefill).

    `logprobs` are the model's temperature-1 log-softmax of each emitted token in float32, what a
    policy-gradient loss compares with the training forward's. The loop on the device stops once every prompt
    has ended. Under `jax.set_mesh(mesh)` the rows split over every mesh axis (`rows` must divide by the device
    count, as the MoE layers split the tokens), the experts run expert-parallel over the model's `expert_axis`,
    and the parameters are put into their compute sharding once, before the loop (`compute_form`). One program
    is compiled per model structure, rows, prompt bucket, width, sampling settings and, with continuous
    batching, the number of prompts rounded up to a power of two.
    """
    check_sampling(temperature, top_k, top_p)
    if temperature > 0 and key is None:
        raise ValueError(
            f"generate(temperature={temperature}) samples and needs key=jax.random.key(seed); temperature=0 is greedy"
        )
    config = model.config
    ids, lengths = _prompt_batch(prompts, prompt_lengths, config.vocab_size)
    count = ids.shape[0]
    budgets = _budgets(max_new_tokens, count)
    too_long = np.flatnonzero(lengths + budgets > config.max_position_embeddings)
    if too_long.size:
        i = int(too_long[0])
        which = "the longest prompt" if isinstance(max_new_tokens, int | np.integer) else f"prompt {i}"
        its = "" if isinstance(max_new_tokens, int | np.integer) else "its "
        raise ValueError(
            f"{which} ({lengths[i]} tokens) plus {its}max_new_tokens={budgets[i]} exceeds the model's "
            f"max_position_embeddings={config.max_position_embeddings}"
        )
    rows = count if rows is None else _rows_arg(rows, count)
    mesh = active_mesh()
    devices = 1 if mesh is None else math.prod(mesh.shape.values())
    if rows % devices:
        raise ValueError(
            f"under the mesh {dict(mesh.shape)} the {rows} rows split over all {devices} devices; the number of "
            f"rows (the prompts', without `rows=`) must be divisible by {devices}"
        )
    settings = _Settings(
        rows=rows,
        continuous=rows < count,
        width=int(budgets.max()),
        temperature=float(temperature),
        top_k=top_k,
        top_p=None if top_p is None else float(top_p),
        eos_token_ids=() if eos_token_id is None else _token_ids(eos_token_id, "eos_token_id", config.vocab_size),
        pad_token_id=0 if pad_token_id is None else _pad_id(pad_token_id, config.vocab_size),
        return_routing=bool(return_routing),
    )
    keys = None if temperature == 0 else _prompt_keys(key, count)
    # With continuous batching the prompts are padded to a power of two (the padding is never taken), so that
    # batches of any size compile a few programs.
    slots = count if rows == count else 1 << (count - 1).bit_length()
    bucket = prompt_bucket(int(lengths.max()))
    padded = np.zeros((slots, bucket), np.int32)
    width = min(bucket, ids.shape[1])
    padded[:count, :width] = ids[:, :width]
    padded_lengths = np.ones((slots,), np.int32)
    padded_lengths[:count] = lengths
    padded_budgets = np.ones((slots,), np.int32)
    padded_budgets[:count] = budgets
    if keys is not None and slots > count:
        keys = jnp.concatenate([keys, jnp.broadcast_to(keys[:1], (slots - count, *keys.shape[1:]))])
    graphdef, state = nnx.split(model)
    out = _run_jit(graphdef, settings, state, padded, padded_lengths, padded_budgets, np.int32(count), keys)
    if slots == count:
        return out
    return Generation(
        out.tokens[:count],
        out.logprobs[:count],
        out.lengths[:count],
        None if out.routing is None else out.routing[:count],
    )


def _budgets(max_new_tokens, count: int) -> np.ndarray:
    """`max_new_tokens` (an int, or one per prompt) as `[count]` int32 budgets, each >= 1."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer | Sequence):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    values = [max_new_tokens] if isinstance(max_new_tokens, int | np.integer) else list(max_new_tokens)
    if any(isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1 for v in values) or not values:
        kind = "an int >= 1" if isinstance(max_new_tokens, int | np.integer) else "one int >= 1 per prompt"
        raise ValueError(f"max_new_tokens must be {kind}, got {max_new_tokens!r}")
    if len(values) not in (1, count):
        raise ValueError(f"max_new_tokens holds {len(values)} budgets for {count} prompts; give one or {count}")
    return np.broadcast_to(np.array(values, np.int32), (count,)).copy()


def _rows_arg(rows, count: int) -> int:
    if isinstance(rows, bool) or not isinstance(rows, int | np.integer) or rows < 1:
        raise ValueError(f"rows must be an int >= 1 (sequences decoded at once), got {rows!r}")
    return min(int(rows), count)


def _prompt_keys(key, count: int) -> jax.Array:
    """One sampling key per prompt: `fold_in(key, i)` for a single key, or the N keys given."""
    if not isinstance(key, jax.Array) or not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        raise TypeError(f"key must be a jax.random.key (or an array of one per prompt), got {key!r:.80}")
    if key.ndim == 0:
        return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(count))
    if key.shape != (count,):
        raise ValueError(f"key holds {key.shape} keys for {count} prompts; give one key or one per prompt")
    return key
