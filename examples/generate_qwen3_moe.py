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

import re
import sys
import time

from jax_megamoe import cli
from moe_training import flags  # the recipes beside this script
from moe_training.tokenizer import Tokenizer, eos_token_ids

DEFAULT_PROMPTS = ("def ", "import ", "class Model:\n    def __init__(self", "    return ")
# The flag that sets each of generate's arguments: its argument errors name the flag.
FLAGS = {
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "eos_token_id": "--eos",
}


def name_flags(message: str, eos: str) -> str:
    """`message` with each of generate's arguments named by its flag, `eos_token_id` by `eos`."""
    flag = dict(FLAGS, eos_token_id=eos)
    return re.sub(rf"\b({'|'.join(flag)})\b", lambda match: flag[match[1]], message)


def parse_args(argv=None):
    parser = cli.Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="config.json + safetensors (save_pretrained's layout)")
    parser.add_argument(
        "--prompt",
        action="append",
        help="a prompt, tokenized as typed (no escapes: let the shell type a newline, as bash's $'a\\nb' does); "
        "repeat for several; default: a few Python openings",
    )
    parser.add_argument("--samples", type=int, default=1, help="continuations per prompt (default: 1)")
    parser.add_argument("--batch", type=int, default=16, help="sequences generated together (default: 16)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens after each prompt (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: 0.8)")
    parser.add_argument("--top-k", type=int, help="keep the k most likely tokens")
    parser.add_argument("--top-p", type=float, help="keep the smallest set of tokens of probability >= p")
    parser.add_argument(
        "--eos",
        type=int,
        action="append",
        help="a token id that ends a sequence (repeatable; default: the eos_token_id of MODEL_DIR's "
        "generation_config.json, else of its config.json; none where neither names one)",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype (default: float32)"
    )
    parser.add_argument(
        "--implementation",
        choices=["auto", "cpu", "cuda", "reference"],
        default="auto",
        help="MoE expert kernels (default: auto)",
    )
    args = parser.parse_args(argv)
    problem = flags.model_dir_problem(args.model_dir)
    if problem:
        parser.error(
            f"MODEL_DIR: {problem}: pass a directory the training job saved (runs/train_qwen3_moe/model after bash "
            "scripts/train.sh) or a Hugging Face Qwen3-MoE checkpoint"
        )
    for prompt in args.prompt or ():
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # bytes that were not UTF-8 on the command line
            parser.error(f"--prompt {prompt!r} is not UTF-8 text")
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

    model = qwen3_moe.from_pretrained(
        args.model_dir, dtype=getattr(jnp, args.dtype), implementation=args.implementation
    )
    config = model.config
    tokenizer = Tokenizer(args.model_dir, config.vocab_size)
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    encoded = [tokenizer.encode(p) for p in prompts for _ in range(args.samples)]
    if any(not ids for ids in encoded):
        raise cli.UsageError("--prompt: a prompt encodes to no tokens; pass some text")
    longest = max(len(ids) for ids in encoded)
    eos = args.eos if args.eos is not None else eos_token_ids(args.model_dir)

    key = jax.random.key(args.seed)
    outputs = []
    generated = 0
    start = time.perf_counter()
    # The bar shows from the first batch's end (delay): an argument error of that batch is all that is printed.
    batches = tqdm(range(0, len(encoded), args.batch), desc="batches", unit="batch", file=sys.stderr, delay=1)
    for first in batches:
        chunk = encoded[first : first + args.batch]
        try:  # generate checks its arguments before anything runs: a ValueError is the command line's
            result = qwen3_moe.generate(
                model,
                chunk,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                eos_token_id=eos or None,
                key=jax.random.fold_in(key, first),
            )
        except ValueError as error:
            eos_flag = "--eos" if args.eos else f"{args.model_dir}'s eos_token_id"
            raise cli.UsageError(name_flags(str(error), eos_flag)) from None
        tokens, lengths = np.asarray(result.tokens), np.asarray(result.lengths)
        outputs += [row[:length] for row, length in zip(tokens, lengths, strict=True)]
        generated += int(lengths.sum())
    seconds = time.perf_counter() - start

    for index, (ids, continuation) in enumerate(zip(encoded, outputs, strict=True)):
        print(f"--- sample {index}: {tokenizer.decode(ids)!r} ->")
        print(tokenizer.decode(continuation))
    plan = qwen3_moe.generation_plan(model, min(args.batch, len(encoded)), longest, args.max_new_tokens)
    print(
        f"{generated} tokens in {seconds:.1f} s ({generated / seconds:.0f} tokens/s, compilation included); "
        f"{qwen3_moe.compiled_programs()} program(s) compiled; KV cache {plan.cache_bytes / 2**20:.2f} MiB "
        f"({plan.cache_length} slots per sequence)"
    )


if __name__ == "__main__":
    cli.run(main)
