"""Tiny random transformers Qwen3-MoE models and their checkpoints in both expert layouts, for the tests that
load Hugging Face checkpoints (transformers and torch are imported by the callers' `importorskip`)."""

from __future__ import annotations

from pathlib import Path

# Three layers, the middle one dense; small enough for CPU tests, with every kind of parameter.
HF_CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[1],
    initializer_range=0.3,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0},
)


def tiny_hf_model(seed: int = 0, **overrides):
    """A tiny random float32 transformers Qwen3-MoE (`HF_CONFIG | overrides`); norms randomised too, so their
    mapping is tested."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**(HF_CONFIG | overrides))).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def save_fused(model, path: Path) -> None:
    """`model` in transformers' in-memory expert layout (`experts.gate_up_proj`, fused over experts): one
    safetensors file and config.json in `path` (`save_pretrained` writes one tensor per expert instead)."""
    from safetensors.torch import save_file

    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    model.config.to_json_file(path / "config.json")
