"""The transformers stack's row: Hugging Face's `Qwen3MoeForCausalLM` and torch's fused AdamW, eager."""

from __future__ import annotations

from .common import BETAS, LEARNING_RATE, WEIGHT_DECAY, error_status, make_tokens, median_ms, model_config, time_steps


def run_torch(args) -> dict:
    try:
        import torch
        import torch.nn.functional as F
        import transformers
        from transformers import Qwen3MoeForCausalLM as HfQwen3Moe
    except Exception as err:  # noqa: BLE001 - a missing peer is a row, not a crash
        return dict(status=f"skipped: torch/transformers not importable ({err!r})")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = dev.type == "cuda"
    row = dict(
        device=torch.cuda.get_device_name(dev) if on_gpu else "cpu",
        platform=dev.type,
        head="torch CE",
        param_dtype="bfloat16",
        remat=False,
        attention_impl="sdpa",
        versions=dict(torch=torch.__version__, transformers=transformers.__version__),
    )
    config = model_config(args.preset, args.layers)

    def sync(_):
        if on_gpu:
            torch.cuda.synchronize()

    try:
        values = {k: v for k, v in config.to_dict().items() if k not in ("architectures", "model_type")}
        hf_config = transformers.Qwen3MoeConfig(**values)
        hf_config.output_router_logits = True
        torch.manual_seed(args.seed)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        kwargs = dict(dtype=torch.bfloat16, attn_implementation="sdpa")
        with torch.device(dev):
            try:  # transformers' own grouped_mm experts where this version offers them
                model = HfQwen3Moe._from_config(hf_config, experts_implementation="grouped_mm", **kwargs)
            except (TypeError, ValueError, ImportError) as err:
                row["experts_fallback"] = repr(err)[:200]
                model = HfQwen3Moe._from_config(hf_config, **kwargs)
        model.train()
        row["experts_implementation"] = getattr(model.config, "_experts_implementation", None) or "eager"
        row["attention_impl"] = model.config._attn_implementation
        row["parameters"] = int(sum(p.numel() for p in model.parameters()))
        try:
            opt = torch.optim.AdamW(
                model.parameters(), lr=LEARNING_RATE, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=True
            )
            row["optimizer"] = "AdamW(fused=True)"
        except (RuntimeError, ValueError) as err:  # fused needs a supported device and dtype
            opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=BETAS, weight_decay=WEIGHT_DECAY)
            row["optimizer"] = f"AdamW (fused unavailable: {str(err)[:100]})"
        tokens, row["tokens_sha1"] = make_tokens(config.vocab_size, args.batch, args.seq, args.seed)
        tokens = torch.from_numpy(tokens).long().to(dev)
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

        def run_step():
            opt.zero_grad(set_to_none=True)
            out = model(input_ids=inputs, use_cache=False, output_router_logits=True)
            lm = F.cross_entropy(out.logits.float().reshape(-1, config.vocab_size), labels.reshape(-1))
            loss = lm + config.router_aux_loss_coef * out.aux_loss
            loss.backward()
            opt.step()
            return loss.detach(), lm.detach()

        (loss, lm), times = time_steps(run_step, sync, args.warmup, args.steps, keep_first=True)
        row.update(
            first_loss=float(loss),
            first_lm_loss=float(lm),
            step_s=times,
            median_step_ms=median_ms(times),
            peak_memory_bytes=int(torch.cuda.max_memory_allocated(dev)) if on_gpu else None,
        )
        row["status"] = "ok"
    except Exception as err:  # noqa: BLE001
        row["status"] = error_status(err)
    return row
