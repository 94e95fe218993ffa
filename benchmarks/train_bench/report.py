"""The table of a run's result, printed at its end."""

from __future__ import annotations


def fmt(value, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def table(result: dict) -> str:
    mm = result["matmul"]
    rate = f"{mm['tflops']:.3g} TF/s" if mm.get("status") == "ok" else mm.get("status", "?")
    config = result["config"]
    lines = [
        (
            f"{result['preset']}: {config['num_hidden_layers']} layers, vocab {config['vocab_size']}, "
            f"batch {result['batch']} x seq {result['seq']} ({result['tokens_per_step']} tokens/step), "
            f"{result['flops_per_step'] / 1e12:.3g} model TFLOP/step; median of {result['steps']} steps after "
            f"{result['warmup']} warm-up"
        ),
        f"bf16 matmul ({mm.get('size')}^3, {mm.get('library')}) in this run: {rate}",
    ]
    w = max(len(r["label"]) for r in result["stacks"]) + 2
    lines.append(
        f"{'stack':<{w}}{'step ms':>9}{'tok/s':>10}{'MFU':>7}{'peak GiB':>10}{'loss0':>8}"
        f"{'experts':>9}{'optim':>8}{'head+CE':>9}{'rest':>8}  status"
    )
    for r in result["stacks"]:
        b = r.get("breakdown", {})
        head = f"{r['label']:<{w}}"
        if r.get("status") != "ok":
            lines.append(f"{head}{'':>78}  {r.get('status')}")
            continue
        lines.append(
            head
            + fmt(r["median_step_ms"], ".1f", 9)
            + fmt(r.get("tokens_per_s"), ",.0f", 10)
            + (fmt(100 * r["mfu"], ".1f", 6) + "%" if r.get("mfu") is not None else fmt(None, "", 7))
            + fmt(r.get("peak_memory_gib"), ".2f", 10)
            + fmt(r.get("first_lm_loss"), ".3f", 8)
            + fmt(b.get("experts_ms"), ".1f", 9)
            + fmt(b.get("optimizer_ms"), ".1f", 8)
            + fmt(b.get("lm_head_loss_ms"), ".1f", 9)
            + fmt(b.get("rest_ms"), ".1f", 8)
            + "  ok"
        )
    lines.append(
        "breakdown (ms): experts = step - step with zero experts; optim = step - step without the update; "
        "head+CE = the LM head and its loss alone (fwd+bwd); rest = the remainder"
    )
    for r in result["stacks"]:
        b = r.get("breakdown") or {}
        if r.get("status") == "ok" and b.get("moe_ffn_alone_ms"):
            lines.append(
                f"{r['label']}: experts {b['experts_ms']:.1f} ms in the step = {b['experts_over_alone']:.2f}x "
                f"the same moe_ffn calls alone ({b['moe_ffn_alone_ms']:.1f} ms, forward+backward with the casts)"
            )
    return "\n".join(lines)
