"""Qwen3-MoE configuration: the fields of Hugging Face's `config.json`, with presets."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig:
    """Qwen3-MoE hyper-parameters; field names are the keys of Hugging Face's `config.json`.

    Defaults are transformers' `Qwen3MoeConfig` defaults, so a `config.json` that omits a key means the
    same here as there. `head_dim=None` means `hidden_size // num_attention_heads`.
    """

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int | None = None
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    router_aux_loss_coef: float = 0.001
    initializer_range: float = 0.02
    hidden_act: str = "silu"
    attention_bias: bool = False
    use_sliding_window: bool = False

    def __post_init__(self):
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        unsupported = {
            "hidden_act": (self.hidden_act, "silu"),
            "attention_bias": (self.attention_bias, False),
            "use_sliding_window": (self.use_sliding_window, False),
        }
        for key, (got, supported) in unsupported.items():
            if got != supported:
                raise ValueError(f"Qwen3MoeConfig.{key}={got!r} is not supported (only {supported!r})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` has sparse experts (else a dense SwiGLU MLP), as in transformers."""
        return (
            self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
            and layer_idx not in self.mlp_only_layers
        )

    def moe_layer_index(self) -> dict[int, int]:
        """`{decoder layer: its index among the sparse layers}` for every sparse layer (the `L_moe` axis of a
        routing record and of `MoEAux.expert_counts`)."""
        sparse = [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]
        return {layer: position for position, layer in enumerate(sparse)}

    def layer_runs(self) -> tuple[tuple[int, int, bool], ...]:
        """`(first layer, layers, is_moe)` of each run of consecutive decoder layers of one kind (sparse or dense),
        in order: the scanned model's stacks. All-sparse models (the published Qwen3-MoE ones) are one run."""
        runs: list[list] = []
        for i in range(self.num_hidden_layers):
            kind = self.is_moe_layer(i)
            if runs and runs[-1][2] == kind:
                runs[-1][1] += 1
            else:
                runs.append([i, 1, kind])
        return tuple(tuple(run) for run in runs)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Qwen3MoeConfig:
        """Builds a config from a `config.json` dict; unknown keys are ignored.

        Understands transformers 5's spellings too: `num_local_experts` for `num_experts`, and
        `rope_parameters = {"rope_type": "default", "rope_theta": ...}` for `rope_theta`. Null values
        mean the default.
        """
        values = dict(values)
        if "num_local_experts" in values:
            values.setdefault("num_experts", values["num_local_experts"])
        rope = values.get("rope_parameters") or values.get("rope_scaling")
        if rope:
            if rope.get("rope_type", rope.get("type", "default")) != "default":
                raise ValueError(f"only default RoPE is supported, got rope parameters {rope}")
            values.setdefault("rope_theta", rope.get("rope_theta", cls.rope_theta))
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in fields and v is not None})

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> Qwen3MoeConfig:
        """Reads a `config.json` file (or the `config.json` inside a checkpoint directory)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no Qwen3-MoE config.json at {path}")
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """The `config.json` contents transformers reads (`model_type` "qwen3_moe")."""
        values = dataclasses.asdict(self)
        values["mlp_only_layers"] = list(self.mlp_only_layers)
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **values}


def qwen3_30b_a3b() -> Qwen3MoeConfig:
    """Qwen/Qwen3-30B-A3B."""
    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        rope_theta=1e6,
        max_position_embeddings=40960,
    )


def qwen3_235b_a22b() -> Qwen3MoeConfig:
    """Qwen/Qwen3-235B-A22B."""
    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        rope_theta=1e6,
        max_position_embeddings=40960,
    )


def tiny() -> Qwen3MoeConfig:
    """A small byte-level model (vocab 256) for tests and CPU runs."""
    return Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        rope_theta=10000.0,
        max_position_embeddings=2048,
    )
