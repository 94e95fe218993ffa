"""Generation for the Qwen3-MoE model: prefill, then a decode loop on the device over a preallocated KV cache,
on the model's own layers and kernels, so the sampler's log-probabilities are the trainer's.

Prompts are right-padded to a bucket (a power of two, at least `MIN_PROMPT_BUCKET`) and keep their own positions:
row b's prompt fills cache slots 0..len_b-1 and its t-th new token goes to slot len_b + t. The whole run, prefill
and the `lax.while_loop` of decode steps, is one compiled program per model, batch size, prompt bucket,
`max_new_tokens` and sampling settings (`compiled_programs` counts them). docs/models.md, "Generation".
"""

from __future__ import annotations

import dataclasses
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
    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    return_routing: bool


class _Loop(NamedTuple):
    step: jax.Array  # [] int32: the index of the next token
    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    done: jax.Array  # [B] bool: the row has emitted an eos token
    cache: KVCache


def _rows(x: jax.Array, axis: int = 0) -> jax.Array:
    """`x` with its rows (dimension `axis`) split over every axis of the active mesh, as the MoE layers split
    the tokens; unchanged without one."""
    mesh = active_mesh()
    if mesh is None:
        return x
    spec: list[Any] = [None] * x.ndim
    spec[axis] = tuple(mesh.axis_names)
    return jax.lax.with_sharding_constraint(x, P(*spec))


@jax.named_scope("sampling")
def _emit(loop: _Loop, logits: jax.Array, key: jax.Array | None, settings: _Settings) -> _Loop:
    """The loop with the next token of every row chosen from `logits [B, V]`."""
    if key is not None:
        key = jax.random.fold_in(key, loop.step)
    logits = logits.astype(jnp.float32)
    token = sample_logits(key, logits, temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p)
    active = ~loop.done
    token = jnp.where(active, token, settings.pad_token_id)
    logprob = jnp.where(active, token_logprobs(logits, token), 0.0)
    stops = jnp.zeros_like(active)
    for eos in settings.eos_token_ids:
        stops |= token == eos
    return loop._replace(
        step=loop.step + 1,
        tokens=jax.lax.dynamic_update_index_in_dim(loop.tokens, token, loop.step, axis=1),
        logprobs=jax.lax.dynamic_update_index_in_dim(loop.logprobs, logprob, loop.step, axis=1),
        lengths=loop.lengths + active,
        done=loop.done | (active & stops),
    )


def _run(graphdef, settings: _Settings, state, prompts, prompt_lengths, key) -> Generation:
    global _programs_compiled
    _programs_compiled += 1  # once per trace: jit traces each program it compiles
    # Every parameter in its compute sharding once, before the loop, so no step gathers FSDP shards.
    model = nnx.merge(graphdef, state).compute_form()
    batch, bucket = prompts.shape
    steps = settings.max_new_tokens
    cache = model.init_cache(batch, bucket + steps, record_routing=settings.return_routing)
    cache = KVCache(
        _rows(cache.k, 1),
        _rows(cache.v, 1),
        _rows(cache.lengths),
        None if cache.routing is None else _rows(cache.routing, 1),
    )
    hidden, cache = model.prefill(_rows(prompts), _rows(prompt_lengths), cache)
    last = jnp.take_along_axis(hidden, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    loop = _Loop(
        step=jnp.zeros((), jnp.int32),
        tokens=jnp.full((batch, steps), settings.pad_token_id, jnp.int32),
        logprobs=jnp.zeros((batch, steps), jnp.float32),
        lengths=jnp.zeros((batch,), jnp.int32),
        done=jnp.zeros((batch,), bool),
        cache=cache,
    )
    loop = _emit(loop, model.logits(last), key, settings)

    def running(loop: _Loop) -> jax.Array:
        return (loop.step < steps) & ~jnp.all(loop.done)

    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)

    @jax.named_scope("decode_step")  # the profiles' name for the loop body (benchmarks/profile_decode.py)
    def decode_step(loop: _Loop) -> _Loop:
        # Modules of the loop body's own trace (flax does not let a transform inside update outer ones).
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        previous = jax.lax.dynamic_index_in_dim(loop.tokens, loop.step - 1, axis=1)
        hidden, cache = model.decode(previous, loop.cache)
        return _emit(loop._replace(cache=cache), model.logits(hidden[:, 0]), key, settings)

    loop = jax.lax.while_loop(running, decode_step, loop)
    routing = None
    if loop.cache.routing is not None:
        routing = _fed_routing(loop.cache.routing, model.config, prompt_lengths, loop.lengths)
    return Generation(loop.tokens, loop.logprobs, loop.lengths, routing)


def _fed_routing(recorded: jax.Array, config: Qwen3MoeConfig, prompt_lengths, lengths) -> jax.Array:
    """The cache's routing record `[layers, B, S, K]` as `[B, S, L_moe, K]` (the sparse layers), -1 at every slot
    whose token was not fed through the model: past a row's prompt and its generated tokens but the last one
    (prefill wrote the padding's slots, and a stopped row keeps feeding padding)."""
    sparse = np.array(sorted(config.moe_layer_index()))
    record = jnp.moveaxis(recorded[sparse], 0, 2)
    fed = jnp.arange(record.shape[1])[None] < (prompt_lengths + lengths - 1)[:, None]
    return jnp.where(fed[:, :, None, None], record, jnp.asarray(-1, record.dtype))


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
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    key: jax.Array | None = None,
    prompt_lengths=None,
    return_routing: bool = False,
) -> Generation:
    """Continues each prompt by up to `max_new_tokens` tokens: `Generation(tokens, logprobs, lengths)`.

    Args:
      model: a `Qwen3MoeForCausalLM` (any `implementation`, `recipe`, `scan_layers`, `attention_impl`).
      prompts: a list of token-id lists (lengths may differ), or a right-padded integer array `[B, L]` with
        `prompt_lengths [B]` (default: every row L tokens).
      max_new_tokens: N >= 1, the width of the results; a prompt's length plus N is at most the config's
        `max_position_embeddings`.
      temperature: 0 is greedy (the most likely token, the lowest id among ties); above 0, tokens are drawn
        from `softmax(process_logits(logits))` with `key` (required then).
      top_k, top_p: the sampling filters of `jax_megamoe.models.sampling.process_logits`, transformers' order
        and ties (this top_k is not the config's experts per token).
      eos_token_id: an id or a list of ids; a row stops after emitting one (counted in its length).
      pad_token_id: the token after a row stops (default 0); its log-probs there are 0.
      key: a `jax.random.key`; each step draws with `fold_in(key, step)`.
      return_routing: also return `Generation.routing [B, bucket + max_new_tokens, L_moe, K]`: the experts each
        sparse layer chose for the token at each position (prompt then completion, the layout of a training row;
        `bucket` is the prompts' padded width, `generation_plan`'s), -1 where nothing was fed (prompt padding,
        positions after a row's last generated token, and that token itself, which is never fed), in the
        narrowest integer type holding the expert ids (`qwen3_moe.routing_dtype`). Pass its first S positions
        as `routing=` to the model's forward over the same rows to replay them. Without it nothing is recorded.

    `logprobs` are the model's temperature-1 log-softmax of each emitted token in float32, what a
    policy-gradient loss compares with the training forward's. The loop on the device stops early once every row
    has stopped. Under `jax.set_mesh(mesh)` the rows split over every mesh axis (B must divide by the device
    count, as the MoE layers split the tokens), the experts run expert-parallel over the model's `expert_axis`,
    and the parameters are put into their compute sharding once, before the loop (`compute_form`).
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    check_sampling(temperature, top_k, top_p)
    if temperature > 0 and key is None:
        raise ValueError(
            f"generate(temperature={temperature}) samples and needs key=jax.random.key(seed); temperature=0 is greedy"
        )
    config = model.config
    ids, lengths = _prompt_batch(prompts, prompt_lengths, config.vocab_size)
    longest = int(lengths.max())
    if longest + max_new_tokens > config.max_position_embeddings:
        raise ValueError(
            f"the longest prompt ({longest} tokens) plus max_new_tokens={max_new_tokens} exceeds the model's "
            f"max_position_embeddings={config.max_position_embeddings}"
        )
    mesh = active_mesh()
    devices = 1 if mesh is None else math.prod(mesh.shape.values())
    if ids.shape[0] % devices:
        raise ValueError(
            f"under the mesh {dict(mesh.shape)} the {ids.shape[0]} prompts split over all {devices} devices; "
            f"the number of prompts must be divisible by {devices}"
        )
    settings = _Settings(
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_k=top_k,
        top_p=None if top_p is None else float(top_p),
        eos_token_ids=() if eos_token_id is None else _token_ids(eos_token_id, "eos_token_id", config.vocab_size),
        pad_token_id=0 if pad_token_id is None else _pad_id(pad_token_id, config.vocab_size),
        return_routing=bool(return_routing),
    )
    bucket = prompt_bucket(longest)
    padded = np.zeros((ids.shape[0], bucket), np.int32)
    width = min(bucket, ids.shape[1])
    padded[:, :width] = ids[:, :width]
    graphdef, state = nnx.split(model)
    return _run_jit(graphdef, settings, state, padded, lengths, key if temperature > 0 else None)
