"""The example jobs' tokenizer, text to token ids and back: a model directory's `tokenizer.json` (through the optional
`tokenizers` package), or UTF-8 bytes as ids 0-255 for a model without one (the training job's byte-level models).
The token that ends a completion is the directory's `eos_token_id`, or a newline in bytes."""

from __future__ import annotations

import json
import os

from jax_megamoe import cli

BYTE_VOCAB = 256


class Tokenizer:
    """`encode(text) -> ids`, `decode(ids) -> text`, and `end_id`, for the model in `model_dir` (None: a model
    without a directory, whose vocabulary holds the 256 byte ids)."""

    def __init__(self, model_dir: str | None, vocab_size: int):
        path = os.path.join(model_dir, "tokenizer.json") if model_dir else None
        self.model_dir = model_dir
        self.tokenizer = None
        if path and os.path.exists(path):
            try:
                import tokenizers
            except ImportError:
                raise cli.UsageError(
                    f"{path} needs the tokenizers package: pip install 'jax_megamoe[text]' "
                    "(or .venv/bin/pip install tokenizers)"
                ) from None
            self.tokenizer = tokenizers.Tokenizer.from_file(path)
        elif model_dir and vocab_size != BYTE_VOCAB:
            raise cli.UsageError(
                f"{model_dir} has no tokenizer.json and a {vocab_size}-token vocabulary (bytes need {BYTE_VOCAB}): "
                "pass a directory with the model's tokenizer.json"
            )
        elif vocab_size < BYTE_VOCAB:
            raise cli.UsageError(f"bytes as tokens need a vocabulary of {BYTE_VOCAB} ids, the model has {vocab_size}")

    @property
    def end_id(self) -> int:
        if self.tokenizer is None or self.model_dir is None:
            return ord("\n")
        return _eos_token_id(self.model_dir)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        if self.tokenizer is None:  # ids past the bytes (a wider model's) decode to U+FFFD
            return bytes(int(i) if i < BYTE_VOCAB else 0xFF for i in ids).decode("utf-8", errors="replace")
        return self.tokenizer.decode([int(i) for i in ids])


def eos_token_ids(model_dir: str) -> list[int]:
    """The `eos_token_id` (an id or a list) of the directory's generation_config.json, else of its config.json, as
    a list; empty where neither names one."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return [int(i) for i in (eos if isinstance(eos, list) else [eos])]
    return []


def _eos_token_id(model_dir: str) -> int:
    """The first of the directory's `eos_token_ids`."""
    ids = eos_token_ids(model_dir)
    if not ids:
        raise cli.UsageError(f"{model_dir} names no eos_token_id (generation_config.json or config.json)")
    return ids[0]
