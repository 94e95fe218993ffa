"""jax_megamoe's Qwen3-MoE and sampler as a tunix model and rollout engine (`pip install 'jax_megamoe[tunix]'`).

A tunix user changes two lines: the actor (and reference) model comes from `from_pretrained` (or
`TunixQwen3Moe(model)` around a `Qwen3MoeForCausalLM`), and `ClusterConfig(rollout_engine=MegaMoeRollout)` replaces
`"vanilla"`. `RLCluster`, `GRPOLearner` and tunix's losses then train and sample on jax_megamoe's kernels.

- `TunixQwen3Moe` takes tunix's call, `model(tokens, positions=, cache=None, attention_mask=[B, L, L],
  segment_ids=[B, L])`, and returns `(float32 logits, None)`. tunix builds `attention_mask` as causal ∧ non-pad
  keys and `segment_ids` as the non-pad mask; the model applies the causal mask itself, and the key mask is the
  mask's last query row (which the causal part hides nothing from). Only what is static is checked (shapes, a
  cache, packing); the values are traced.
- `MegaMoeRollout` samples with `jax_megamoe.models.qwen3_moe.generate` and returns what tunix's vanilla engine
  returns: completion tokens up to (not including) the first stop token, left-padded prompts, and, when asked, the
  sampled tokens' log-probs in tunix's convention, `log_softmax(logits / T)` over the whole vocabulary (no top-k or
  top-p filtering; greedy: T = 1). The pad id is a stop token too, so no completion token equals it and tunix's
  completion mask `tokens != pad_id` marks exactly the sampled tokens: a vocabulary without a spare id (bytes) uses
  its eos id as the pad id.
- Meshes: tunix enters a role's mesh with `with mesh:`, while jax_megamoe's layers read
  `jax.sharding.get_abstract_mesh()` (what `jax.set_mesh` sets). Both run the model on the entered mesh, with the
  experts over the model's `expert_axis`: the adapter makes a `with mesh:` mesh the abstract mesh for its call, and
  the rollout samples under `jax.set_mesh` of the mesh `RLCluster` gives it.

What tunix 0.1.7 does not carry (docs/tunix.md): the MoE auxiliary losses (its losses call
`logits, _ = model(...)` and add no model-side term, so the router learns only through the policy gradient), and
routing replay (`GRPOLearner` passes the model no recorded routing).
"""

from __future__ import annotations

import contextlib
import json
import operator
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.interpreters import pxla
from jax.sharding import Mesh

from jax_megamoe.models import qwen3_moe

try:
    from tunix.generate import tokenizer_adapter
    from tunix.rl import common
    from tunix.rl.rollout import base_rollout
except ImportError as error:  # without the extra
    raise ImportError(
        f"jax_megamoe.integrations.tunix needs tunix: pip install 'jax_megamoe[tunix]' ({error})"
    ) from error

__all__ = ["ByteTokenizer", "MegaMoeRollout", "TunixQwen3Moe", "from_pretrained", "load_tokenizer"]


def _entered_mesh() -> Mesh | None:
    """The mesh entered with `with mesh:` (how tunix enters a role's mesh), read where tunix itself reads it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # tunix 0.1.7's own way of entering a mesh
        mesh = pxla.thread_resources.env.physical_mesh
    return None if mesh.empty else mesh


@contextlib.contextmanager
def _abstract_mesh_of_entered_mesh() -> Iterator[None]:
    """Makes a mesh entered with `with mesh:` the abstract mesh that jax_megamoe's layers read, unless `jax.set_mesh`
    already set one; works inside `jit`, where `jax.set_mesh` may not be called."""
    mesh = _entered_mesh() if jax.sharding.get_abstract_mesh().empty else None
    if mesh is None:
        yield
    else:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            yield


def _record_meshes(model: nnx.Module) -> None:
    """Gives every parameter that flax shards eagerly (one created under `jax.set_mesh`) its mesh as metadata.

    flax shards such a variable, and each optimizer state made from it (`nnx.Optimizer`), over the abstract mesh of
    the moment it is created, or over its `mesh` metadata. tunix creates its optimizer under `with mesh:`, where flax
    sees no mesh; with the parameter's own mesh recorded, the optimizer state is sharded as the parameter."""
    for _, variable in nnx.iter_graph(model):
        if not isinstance(variable, nnx.Variable):
            continue
        metadata = variable.get_metadata()
        sharding = getattr(variable.get_value(), "sharding", None)
        if (
            metadata.get("eager_sharding")
            and metadata.get("out_sharding") is not None
            and metadata.get("mesh") is None
            and isinstance(sharding, jax.sharding.NamedSharding)
        ):
            variable.set_metadata("mesh", sharding.mesh)


def _check_auto_axes(mesh: Mesh | None) -> None:
    """Raises for a mesh with Explicit axes (`jax.make_mesh`'s default): jax_megamoe's layers and sampler shard
    through sharding constraints and `shard_map` over Auto axes."""
    if mesh is not None and any(axis != jax.sharding.AxisType.Auto for axis in mesh.axis_types):
        raise ValueError(
            f"jax_megamoe runs on meshes with Auto axes, got axis types {mesh.axis_types}: make the mesh with "
            "jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names)) or jax.sharding.Mesh"
        )


def _shape(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


class TunixQwen3Moe(nnx.Module):
    """A `Qwen3MoeForCausalLM` behind tunix's model call: `logits, cache = adapter(tokens, positions=...,
    cache=None, attention_mask=..., segment_ids=...)`.

    Its parameters are the wrapped model's (`adapter.model`), under the path prefix `model`. Training and
    log-probs run jax_megamoe's forward (its MoE kernels, `implementation`, `remat`, scanned layers); sampling
    goes through `MegaMoeRollout`, not through this call, so the call takes no KV cache. The model's `MoEAux` is
    dropped: tunix's losses read only the logits.
    """

    def __init__(self, model: qwen3_moe.Qwen3MoeForCausalLM):
        if not isinstance(model, qwen3_moe.Qwen3MoeForCausalLM):
            raise TypeError(
                f"TunixQwen3Moe wraps a jax_megamoe Qwen3MoeForCausalLM, got {type(model).__name__}; "
                "load one with jax_megamoe.integrations.tunix.from_pretrained(path)"
            )
        _record_meshes(model)
        self.model = model

    @property
    def config(self) -> qwen3_moe.Qwen3MoeConfig:
        """The wrapped model's config."""
        return self.model.config

    def __call__(
        self,
        input_tokens: jax.Array,
        positions: jax.Array | None = None,
        cache: Any = None,
        attention_mask: jax.Array | None = None,
        *,
        segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, None]:
        """`(logits [B, L, vocab] float32, None)` of `input_tokens [B, L]`.

        Args:
          input_tokens: token ids `[B, L]`.
          positions: RoPE positions `[B, L]` or `[L]` (default `0..L-1`); tunix counts them from 0 at each row's
            first non-pad token.
          cache: must be None (sampling runs in `MegaMoeRollout` on jax_megamoe's own KV cache).
          attention_mask: `[B, L, L]`, tunix's causal ∧ non-pad-keys mask, or None (causal only). The key mask is
            its last row, `attention_mask[:, L - 1]`, exactly the non-pad keys of tunix's mask; the causal part the
            model applies itself.
          segment_ids: `[B, L]`, tunix's non-pad mask, passed beside `attention_mask` (the same information);
            alone it is tunix's sequence packing, which this model does not run.
        """
        if cache is not None:
            raise ValueError(
                "TunixQwen3Moe runs whole sequences without a KV cache (training and log-probs); sampling goes "
                "through jax_megamoe.integrations.tunix.MegaMoeRollout (ClusterConfig(rollout_engine=MegaMoeRollout)), "
                f"got a cache of type {type(cache).__name__}"
            )
        tokens_shape = _shape(input_tokens)
        if len(tokens_shape) != 2:
            raise ValueError(f"input_tokens must be [batch, length] token ids, got shape {tokens_shape}")
        batch, length = tokens_shape
        if positions is not None and _shape(positions) not in ((batch, length), (length,)):
            raise ValueError(
                f"positions must be [batch, length] = [{batch}, {length}] (or [{length}]), got shape "
                f"{_shape(positions)}"
            )
        if segment_ids is not None and _shape(segment_ids) != (batch, length):
            raise ValueError(
                f"segment_ids must be [batch, length] = [{batch}, {length}] (tunix's non-pad mask), got shape "
                f"{_shape(segment_ids)}"
            )
        key_mask = None
        if attention_mask is not None:
            if _shape(attention_mask) != (batch, length, length):
                raise ValueError(
                    f"attention_mask must be [batch, length, length] = [{batch}, {length}, {length}] (tunix's causal "
                    f"mask of the whole sequence; no cache), got shape {_shape(attention_mask)}"
                )
            key_mask = attention_mask[:, length - 1, :]
        elif segment_ids is not None:
            raise ValueError(
                "segment_ids without attention_mask is tunix's sequence packing (several documents per row), which "
                "TunixQwen3Moe does not run: pass attention_mask, or leave packing off"
            )
        with _abstract_mesh_of_entered_mesh():
            logits, _ = self.model(input_tokens, positions, attention_mask=key_mask)
        return logits.astype(jnp.float32), None


def from_pretrained(path: str | os.PathLike, **kwargs) -> TunixQwen3Moe:
    """A Hugging Face Qwen3-MoE checkpoint directory as a tunix model: `TunixQwen3Moe(qwen3_moe.from_pretrained(path,
    **kwargs))` (`dtype`, `mesh` (experts over its `expert` axis, FSDP over `data`), `implementation`, `remat`, ...:
    docs/models.md)."""
    _check_auto_axes(kwargs.get("mesh"))
    return TunixQwen3Moe(qwen3_moe.from_pretrained(path, **kwargs))


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255, for byte-level models such as the `tiny` preset: a newline ends a completion,
    and, as a 256-id vocabulary has no spare id, the newline is the pad id too (no completion holds it, as the
    rollout stops at it). No BOS. tunix's `TokenizerAdapter` takes it as it is."""

    VOCAB = 256

    def encode(self, text: str, **kwargs) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], **kwargs) -> str:
        return bytes(int(i) if 0 <= int(i) < self.VOCAB else 0xFF for i in ids).decode("utf-8", errors="replace")

    def bos_id(self) -> int | None:
        return None

    def eos_id(self) -> int:
        return ord("\n")

    def pad_id(self) -> int:
        return self.eos_id()


def load_tokenizer(model_dir: str | os.PathLike) -> Any:
    """The tokenizer of a model directory: transformers' `AutoTokenizer` where the directory has a `tokenizer.json`
    or `tokenizer_config.json`, else `ByteTokenizer` for a 256-token vocabulary (the training job's byte-level
    models). Pass it to `RLCluster(tokenizer=...)`."""
    model_dir = os.fspath(model_dir)
    if any(os.path.exists(os.path.join(model_dir, name)) for name in ("tokenizer.json", "tokenizer_config.json")):
        import transformers

        return transformers.AutoTokenizer.from_pretrained(model_dir)
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"{model_dir} holds no tokenizer.json, tokenizer_config.json or config.json")
    with open(config_path) as f:
        vocab_size = json.load(f).get("vocab_size")
    if vocab_size != ByteTokenizer.VOCAB:
        raise ValueError(
            f"{model_dir} has no tokenizer files and a {vocab_size}-token vocabulary (bytes need "
            f"{ByteTokenizer.VOCAB}): pass a directory with the model's tokenizer.json"
        )
    return ByteTokenizer()


def _token_id(value, name: str, vocab_size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"the tokenizer's {name} must be an int token id, got {value!r}")
    if not 0 <= value < vocab_size:
        raise ValueError(f"the tokenizer's {name} {value} is outside the model's vocabulary [0, {vocab_size})")
    return int(value)


def _seed_key(seed) -> jax.Array | None:
    if seed is None:
        return None
    if isinstance(seed, int | np.integer) and not isinstance(seed, bool):
        return jax.random.key(int(seed))
    return seed


class MegaMoeRollout(base_rollout.BaseRollout):
    """tunix's rollout engine interface on `jax_megamoe.models.qwen3_moe.generate`:
    `ClusterConfig(rollout_engine=MegaMoeRollout)`; `RLCluster` builds it with `rollout_actor`, `tokenizer`,
    `mesh` and the train `rollout_config`.

    Args:
      rollout_actor: the `TunixQwen3Moe` to sample from; `RLCluster` passes the trainer's own module, so the rollout
        shares the trainer's parameters and samples with every update without a copy.
      tokenizer: a tokenizer tunix's `TokenizerAdapter` takes (Hugging Face, SentencePiece, or one with `encode`,
        `decode`, `bos_id`, `eos_id`, `pad_id`, such as `ByteTokenizer`); it needs a pad id inside the vocabulary.
      mesh: the rollout's mesh (None or one device: no mesh); under it the rows split over every axis and the
        experts run expert-parallel over the model's `expert_axis`.
      rollout_config: tunix's `RolloutConfig` of training; its temperature is the one `get_per_token_logps` divides
        by, and its `eos_tokens` (default: the tokenizer's eos id) plus the pad id are the stop tokens.

    Each `generate` call samples with the `RolloutConfig` it is given: `max_tokens_to_generate`, `temperature` (0:
    greedy), `top_k` (None or < 1: off), `top_p` (None or 1: off; transformers' filters,
    `jax_megamoe.models.sampling.process_logits`), `max_prompt_length` (the left-padded prompts' width, widened to
    the next power of two past the longest prompt, as tunix's vanilla engine does), `seed` (an int or a key: that key
    every call, as the vanilla engine; None: a fresh key each call), `eos_tokens`, `return_logprobs`. `kv_cache_size`
    is not read: `generate` sizes its own cache. Bad input (an empty prompt, a prompt holding the pad id, which
    tunix's trainer would take for padding) raises before anything runs.
    """

    def __init__(
        self,
        rollout_actor: TunixQwen3Moe,
        tokenizer: Any,
        mesh: Mesh | None = None,
        rollout_config: base_rollout.RolloutConfig | None = None,
    ):
        if not isinstance(rollout_actor, TunixQwen3Moe):
            raise TypeError(
                "MegaMoeRollout samples from a jax_megamoe model: the actor must be a TunixQwen3Moe "
                f"(jax_megamoe.integrations.tunix.from_pretrained), got {type(rollout_actor).__name__}"
            )
        _check_auto_axes(mesh)
        self._actor = rollout_actor
        self._config = rollout_config if rollout_config is not None else base_rollout.RolloutConfig()
        self.mesh = mesh
        if not isinstance(tokenizer, tokenizer_adapter.TokenizerAdapter):
            tokenizer = tokenizer_adapter.TokenizerAdapter(tokenizer)
        self._tokenizer = tokenizer
        vocab_size = rollout_actor.config.vocab_size
        try:
            pad = tokenizer.pad_id()
        except ValueError as error:  # SentencePiece without one
            pad, reason = None, f" ({error})"
        else:
            reason = ""
        if pad is None or (isinstance(pad, int | np.integer) and pad < 0):
            raise ValueError(
                f"the tokenizer has no pad id{reason}: tunix marks completion tokens as `tokens != pad_id` and pads "
                "prompts with it, so MegaMoeRollout needs one; give the tokenizer a pad id (its eos id serves: "
                "sampling stops at the pad id, so no completion holds it)"
            )
        self._pad = _token_id(pad, "pad id", vocab_size)
        self._eos = self._eos_ids(self._config, vocab_size)
        self._calls = 0

    def _eos_ids(self, config: base_rollout.RolloutConfig, vocab_size: int) -> list[int]:
        if config.eos_tokens:
            return [_token_id(token, "eos token (RolloutConfig.eos_tokens)", vocab_size) for token in config.eos_tokens]
        eos = self._tokenizer.eos_id()
        if eos is None:
            raise ValueError("the tokenizer has no eos id; set RolloutConfig(eos_tokens=[...]) for MegaMoeRollout")
        return [_token_id(eos, "eos id", vocab_size)]

    @contextlib.contextmanager
    def _on_mesh(self) -> Iterator[None]:
        if self.mesh is None or self.mesh.size == 1:
            yield
        else:
            with jax.set_mesh(self.mesh):
                yield

    def _prompt_ids(self, prompts: Sequence[str]) -> list[list[int]]:
        if isinstance(prompts, str) or len(prompts) == 0:
            raise ValueError(f"prompts must be a non-empty list of strings, got {prompts!r}")
        bos = self._tokenizer.bos_id()
        rows = []
        for i, prompt in enumerate(prompts):
            ids = [operator.index(t) for t in self._tokenizer.encode(prompt)]
            if bos is not None:
                ids = self._tokenizer.dedup_bos_ids([bos, *ids])
            if not ids:
                raise ValueError(f"prompt {i} ({prompt!r}) encodes to no tokens; every prompt needs at least one")
            if self._pad in ids:
                raise ValueError(
                    f"prompt {i} ({prompt!r}) holds the pad id {self._pad} at token {ids.index(self._pad)}: tunix's "
                    "trainer takes every token equal to the pad id for padding (its mask is `tokens != pad_id`), so "
                    "it would train on other positions than were sampled; remove that token from the prompt or "
                    "give the tokenizer another pad id"
                )
            rows.append(ids)
        return rows

    def generate(
        self, prompts: list[str], rollout_config: base_rollout.RolloutConfig, **kwargs
    ) -> base_rollout.RolloutOutput:
        """Samples a completion of each prompt (`RolloutOutput`: texts, completion tokens before the first stop
        token, left-padded prompt tokens, and with `return_logprobs` the tokens' `log_softmax(logits / T)`)."""
        rows = self._prompt_ids(prompts)
        model = self._actor.model
        vocab_size = model.config.vocab_size
        stops = sorted({*self._eos_ids(rollout_config, vocab_size), self._pad})
        width = max(rollout_config.max_prompt_length, 1)
        longest = max(len(row) for row in rows)
        if longest > width:
            width = 1 << (longest - 1).bit_length()
        prompt_tokens = np.full((len(rows), width), self._pad, np.int32)
        for i, row in enumerate(rows):
            prompt_tokens[i, width - len(row) :] = row
        temperature = float(rollout_config.temperature)
        top_k = rollout_config.top_k if rollout_config.top_k is not None and rollout_config.top_k > 0 else None
        top_p = rollout_config.top_p if rollout_config.top_p is not None and rollout_config.top_p < 1 else None
        key = _seed_key(rollout_config.seed)
        if key is None and temperature > 0:
            key = jax.random.fold_in(jax.random.key(0), self._calls)
        self._calls += 1
        # Under a mesh the rows split over every device: repeat the last prompt up to a multiple of the devices.
        devices = 1 if self.mesh is None else self.mesh.size
        padded_rows = rows + [rows[-1]] * (-len(rows) % devices)
        with self._on_mesh():
            out = qwen3_moe.generate(
                model,
                padded_rows,
                max_new_tokens=rollout_config.max_tokens_to_generate,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                eos_token_id=stops,
                pad_token_id=self._pad,
                key=key if temperature > 0 else None,
            )
        tokens, lengths, logprobs = jax.device_get((out.tokens, out.lengths, out.logprobs))
        completions: list[np.ndarray] = []
        for b in range(len(rows)):
            sampled = np.asarray(tokens[b, : lengths[b]], np.int32)
            completions.append(sampled[:-1] if sampled.size and int(sampled[-1]) in stops else sampled)
        texts = [self._tokenizer.decode(completion.tolist()) for completion in completions]
        sampled_logprobs = None
        if rollout_config.return_logprobs:
            if temperature not in (0.0, 1.0):
                # generate's own log-probs are log_softmax(logits), tunix's at T = 1 (and greedy): at another T, one
                # forward over the sampled sequences.
                padded = np.full((len(rows), rollout_config.max_tokens_to_generate), self._pad, np.int32)
                for b, completion in enumerate(completions):
                    padded[b, : completion.size] = completion
                logprobs = jax.device_get(self._per_token_logps(prompt_tokens, padded, temperature))
            sampled_logprobs = [np.asarray(logprobs[b, : c.size], np.float32) for b, c in enumerate(completions)]
        return base_rollout.RolloutOutput(
            text=texts,
            logits=[],
            tokens=completions,
            left_padded_prompt_tokens=prompt_tokens,
            logprobs=sampled_logprobs,
        )

    def _per_token_logps(self, prompt_tokens, completion_tokens, temperature: float) -> jax.Array:
        graphdef, state = nnx.split(self._actor)
        with self._on_mesh():
            return common.compute_per_token_logps(
                graphdef,
                state,
                prompt_tokens=jnp.asarray(prompt_tokens),
                completion_tokens=jnp.asarray(completion_tokens),
                pad_id=self._pad,
                eos_id=self._eos[0],
                stop_gradient=True,
                temperature=temperature,
            )

    def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array) -> jax.Array:
        """`[B, completion length]` log-probs of the completion tokens under the rollout's parameters, by tunix's own
        `compute_per_token_logps` at the train rollout config's temperature: the convention `GRPOLearner`'s loss
        compares them in (tunix's vanilla engine computes them at temperature 1)."""
        return self._per_token_logps(prompt_tokens, completion_tokens, float(self._config.temperature))

    def update_params(self, params: Any, filter_types: tuple[Any, ...] | None = None) -> None:
        """Loads the trainer's `params` (an `nnx.State` of the same model's variables). Where the rollout shares the
        trainer's module, as `RLCluster` sets it up, they are the rollout's own arrays already and nothing is
        copied; else each array is put into the rollout's sharding and dtype."""
        filters = tuple(filter_types) if filter_types else (nnx.Param,)
        current = nnx.state(self._actor, *filters)
        new_paths, new_leaves = zip(*jax.tree_util.tree_flatten_with_path(params)[0], strict=True)
        cur_items, treedef = jax.tree_util.tree_flatten_with_path(current)
        cur_paths = tuple(path for path, _ in cur_items)
        if tuple(new_paths) != cur_paths:
            missing = sorted(set(map(jax.tree_util.keystr, cur_paths)) ^ set(map(jax.tree_util.keystr, new_paths)))
            raise ValueError(
                f"update_params got parameters of another model: {len(new_paths)} arrays against the rollout's "
                f"{len(cur_paths)}, first differing path {missing[:1]}"
            )
        cur_leaves = [leaf for _, leaf in cur_items]
        if all(new is cur for new, cur in zip(new_leaves, cur_leaves, strict=True)):
            return
        moved = [
            jax.device_put(jnp.asarray(new).astype(cur.dtype), cur.sharding)
            for new, cur in zip(new_leaves, cur_leaves, strict=True)
        ]
        nnx.update(self._actor, jax.tree_util.tree_unflatten(treedef, moved))

    def pad_id(self) -> int:
        return self._pad

    def eos_id(self) -> int:
        return self._eos[0]

    def model(self) -> TunixQwen3Moe:
        return self._actor
