"""Sample from a Qwen3-MoE model directory with jax_megamoe's kernels: the model the training job saved, or any
Hugging Face Qwen3-MoE checkpoint directory.

    python examples/generate_qwen3_moe.py runs/train_qwen3_moe/model
    python examples/generate_qwen3_moe.py runs/train_qwen3_moe/model --prompt "def " --prompt "class " --temperature 0
    python examples/generate_qwen3_moe.py path/to/Qwen3-30B-A3B --prompt "The capital of France is" --dtype bfloat16

Text becomes tokens through the directory's `tokenizer.json` (the optional `tokenizers` package) or, for a
256-token vocabulary without one (the training job's byte-level models), as bytes. Prints each prompt and its
continuation, then the generated tokens per second, the programs compiled and the KV cache's size. Docs:
docs/models.md, "Generation".
"""

from __future__ import annotations

import os
import sys
import time

from jax_megamoe import cli
from moe_training.text import Text  # the recipes beside this script

DEFAULT_PROMPTS = ("def ", "import ", "class Model:\n    def __init__(self", "    return ")


def parse_args(argv=None):
    parser = cli.Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="config.json + safetensors (save_pretrained's layout)")
    parser.add_argument(
        "--prompt", action="append", help="a prompt (repeat for several); default: a few Python openings"
    )
    parser.add_argument("--samples", type=int, default=1, help="continuations per prompt (default: 1)")
    parser.add_argument("--batch", type=int, default=16, help="sequences generated together (default: 16)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens after each prompt (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: 0.8)")
    parser.add_argument("--top-k", type=int, help="keep the k most likely tokens")
    parser.add_argument("--top-p", type=float, help="keep the smallest set of tokens of probability >= p")
    parser.add_argument("--eos", type=int, action="append", help="a token id that ends a sequence (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype")
    parser.add_argument(
        "--implementation",
        choices=["auto", "cpu", "cuda", "reference"],
        default="auto",
        help="MoE expert kernels (default: auto)",
    )
    args = parser.parse_args(argv)
    for flag, value, least in (("--samples", args.samples, 1), ("--batch", args.batch, 1)):
        if value < least:
            parser.error(f"{flag} must be at least {least}, got {value}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from jax_megamoe.models import qwen3_moe

    if not os.path.exists(os.path.join(args.model_dir, "config.json")):
        raise cli.UsageError(
            f"MODEL_DIR {args.model_dir} has no config.json: pass a directory the training job saved "
            "(runs/train_qwen3_moe/model after bash scripts/train.sh) or a Hugging Face Qwen3-MoE checkpoint"
        )
    model = qwen3_moe.from_pretrained(
        args.model_dir, dtype=getattr(jnp, args.dtype), implementation=args.implementation
    )
    config = model.config
    text = Text(args.model_dir, config.vocab_size)
    prompts = [p.encode().decode("unicode_escape") for p in args.prompt] if args.prompt else list(DEFAULT_PROMPTS)
    encoded = [text.encode(p) for p in prompts for _ in range(args.samples)]
    if any(not ids for ids in encoded):
        raise cli.UsageError("--prompt: a prompt encodes to no tokens; pass some text")
    longest = max(len(ids) for ids in encoded)

    key = jax.random.key(args.seed)
    outputs = []
    generated = 0
    start = time.perf_counter()
    for first in tqdm(range(0, len(encoded), args.batch), desc="batches", unit="batch", file=sys.stderr):
        chunk = encoded[first : first + args.batch]
        try:  # generate checks its arguments before anything runs: a ValueError is the command line's
            result = qwen3_moe.generate(
                model,
                chunk,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                eos_token_id=args.eos,
                key=jax.random.fold_in(key, first),
            )
        except ValueError as error:
            raise cli.UsageError(f"{error} (--max-new-tokens, --temperature, --top-k, --top-p, --eos)") from None
        tokens, lengths = np.asarray(result.tokens), np.asarray(result.lengths)
        outputs += [row[:length] for row, length in zip(tokens, lengths, strict=True)]
        generated += int(lengths.sum())
    seconds = time.perf_counter() - start

    for index, (ids, continuation) in enumerate(zip(encoded, outputs, strict=True)):
        print(f"--- sample {index}: {text.decode(ids)!r} ->")
        print(text.decode(continuation))
    plan = qwen3_moe.generation_plan(model, min(args.batch, len(encoded)), longest, args.max_new_tokens)
    print(
        f"{generated} tokens in {seconds:.1f} s ({generated / seconds:.0f} tokens/s, compilation included); "
        f"{qwen3_moe.compiled_programs()} program(s) compiled; KV cache {plan.cache_bytes / 2**20:.2f} MiB "
        f"({plan.cache_length} slots per sequence)"
    )


if __name__ == "__main__":
    cli.run(main)
