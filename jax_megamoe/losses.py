"""The LM head fused with its cross-entropy, without the `[N, V]` logits.

`linear_cross_entropy(hidden, kernel, labels)` equals optax's softmax cross-entropy of `hidden @ kernel`, but
runs over chunks of tokens: each chunk's logits live only inside one step of a scan. Under differentiation the
forward computes the gradients too, chunk by chunk: the logits GEMM, then one kernel over the chunk's rows
(`_targets.CROSS_ENTROPY_ROWS`: softmax, loss and the logits' gradient, written over the logits), then the two
gradient GEMMs. That is three GEMMs instead of the four that recomputing the logits in the backward would take,
and the reason the loss is a scalar. The float32 kernel gradient `[H, V]` accumulates across chunks; the hidden
gradient is written chunk by chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_megamoe import _ffi, _targets
from jax_megamoe.ops.moe import resolve_implementation
from jax_megamoe.ops.validation import check_array, check_float, check_rank

REDUCTIONS = ("mean", "sum")
# Each chunk's logits take at most about this many bytes (the gradient is written over them). Each chunk also adds
# its [H, V] float32 kernel gradient into the accumulator, a read and a write of 8·H·V bytes: below ~600 tokens per
# chunk that traffic outlasts the chunk's GEMMs on an H200, so the budget allows large chunks (3532 tokens of bf16
# logits at V = 151936).
_CHUNK_LOGITS_BYTES = 1 << 30
# The dtypes the kernels' cross-entropy rows take; other logits run the reference.
_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _chunk_tokens(tokens: int, vocab: int, itemsize: int) -> int:
    """Tokens per chunk: the fewest chunks within the logits budget, of equal size (little padding)."""
    largest = max(1, min(tokens, _CHUNK_LOGITS_BYTES // (itemsize * vocab)))
    chunks = -(-tokens // largest)
    return -(-tokens // chunks)


def _matmul_precision(dtype):
    # float32 inputs get float32 products (GPUs otherwise take tf32); narrower inputs run at their own rate.
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _reference_rows(logits, labels, mask, scale):
    """Per-row losses and `scale * d loss / d logits` (in the logits' dtype) of one chunk, in float32 math: the
    semantics of the kernels' cross-entropy rows (`_targets.CROSS_ENTROPY_ROWS`)."""
    x = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=-1)
    safe = jnp.where(mask, labels, 0)
    label_logit = jnp.take_along_axis(x, safe[:, None], axis=-1)[:, 0]
    loss = jnp.where(mask, lse - label_logit, 0.0)
    grad = jnp.exp(x - lse[:, None]) - jax.nn.one_hot(safe, x.shape[-1], dtype=jnp.float32)
    return loss, (jnp.where(mask[:, None], grad, 0.0) * scale).astype(logits.dtype)


def _rows(implementation, logits, labels, mask, scale):
    if implementation == "reference":
        return _reference_rows(logits, labels, mask, scale)
    shapes = (jax.ShapeDtypeStruct(labels.shape, jnp.float32), jax.ShapeDtypeStruct(logits.shape, logits.dtype))
    return _ffi.call(_targets.CROSS_ENTROPY_ROWS[implementation], shapes, logits, jnp.where(mask, labels, -1), scale)


def _scan_chunks(hidden, kernel, labels, mask, scale, implementation, with_grad: bool):
    """`(loss sum, d hidden, d kernel)` over token chunks (the gradients None without `with_grad`)."""
    tokens, width = hidden.shape
    dtype = jnp.promote_types(hidden.dtype, kernel.dtype)
    chunk = _chunk_tokens(tokens, kernel.shape[1], dtype.itemsize)
    chunks = -(-tokens // chunk)
    pad = chunks * chunk - tokens
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(chunks, chunk, width)
    lab = jnp.pad(labels, (0, pad)).reshape(chunks, chunk)
    msk = jnp.pad(mask, (0, pad)).reshape(chunks, chunk)
    precision = _matmul_precision(dtype)

    def step(carry, xs):
        loss, d_kernel = carry
        h_c, lab_c, msk_c = xs
        # The logits in the operands' dtype (float32 accumulation), as `h_c @ kernel` gives them.
        logits = jnp.dot(h_c, kernel, preferred_element_type=dtype, precision=precision)
        if not with_grad:  # the loss alone needs no kernel: XLA's reductions over the chunk
            return (loss + jnp.sum(_reference_rows(logits, lab_c, msk_c, scale)[0]), d_kernel), None
        loss_rows, g = _rows(implementation, logits, lab_c, msk_c, scale)
        g = g.astype(hidden.dtype)
        d_h = jnp.dot(g, kernel.T, preferred_element_type=jnp.float32, precision=precision).astype(hidden.dtype)
        d_kernel = d_kernel + jnp.dot(h_c.T, g, preferred_element_type=jnp.float32, precision=precision)
        return (loss + jnp.sum(loss_rows), d_kernel), d_h

    d_kernel = jnp.zeros(kernel.shape, jnp.float32) if with_grad else None
    (loss, d_kernel), d_h = jax.lax.scan(step, (jnp.zeros((), jnp.float32), d_kernel), (h, lab, msk))
    if not with_grad:
        return loss, None, None
    return loss, d_h.reshape(chunks * chunk, width)[:tokens], d_kernel


def _scale(mask, reduction: str):
    if reduction == "sum":
        return jnp.ones((), jnp.float32)
    return 1.0 / jnp.maximum(jnp.sum(mask, dtype=jnp.float32), 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _linear_cross_entropy(hidden, kernel, labels, mask, reduction, implementation):
    loss, _, _ = _scan_chunks(hidden, kernel, labels, mask, 1.0, implementation, with_grad=False)
    return loss * _scale(mask, reduction)


def _lce_fwd(hidden, kernel, labels, mask, reduction, implementation):
    scale = _scale(mask, reduction)
    loss, d_hidden, d_kernel = _scan_chunks(hidden, kernel, labels, mask, scale, implementation, with_grad=True)
    return loss * scale, (d_hidden, d_kernel.astype(kernel.dtype), labels, mask)


def _lce_bwd(reduction, implementation, residuals, d_loss):
    d_hidden, d_kernel, labels, mask = residuals
    zero_int = np.zeros((), jax.dtypes.float0)
    return (
        (d_hidden * d_loss).astype(d_hidden.dtype),
        (d_kernel * d_loss).astype(d_kernel.dtype),
        np.broadcast_to(zero_int, labels.shape),
        np.broadcast_to(zero_int, mask.shape),
    )


_linear_cross_entropy.defvjp(_lce_fwd, _lce_bwd)


def linear_cross_entropy(
    hidden: jax.Array,
    kernel: jax.Array,
    labels: jax.Array,
    *,
    where: jax.Array | None = None,
    reduction: str = "mean",
    implementation: str = "auto",
) -> jax.Array:
    """Softmax cross-entropy of `hidden @ kernel` against `labels`, as a float32 scalar.

    Args:
      hidden: `[N, H]` final hidden states (any float dtype; bf16 runs the GEMMs in bf16 with float32
        accumulation).
      kernel: `[H, V]` the LM head (for tied embeddings, the embedding table transposed).
      labels: `[N]` integer target ids; labels < 0 (e.g. -100) are ignored, as `where=False`.
      where: optional `[N]` bool, the tokens that count.
      reduction: `"mean"` over the counted tokens (0 when none counts), or `"sum"` (for callers that shard the
        tokens, e.g. inside `shard_map`, and reduce themselves).
      implementation: the kernel over each chunk's rows, as for `moe_ffn`: `"auto"` (the CUDA kernel on a GPU,
        the CPU kernel on a CPU, the reference where none was built or for logits other than bf16 and float32),
        `"cuda"`, `"cpu"`, or `"reference"` (XLA's reductions).

    Equals `optax.softmax_cross_entropy_with_integer_labels(hidden @ kernel, labels)` reduced over the counted
    tokens, value and gradients (in `hidden` and `kernel`), without materialising the `[N, V]` logits. The logits
    are `hidden @ kernel` in the operands' dtype (bf16 inputs: bf16 logits from float32 accumulation, as the
    unfused product gives them); softmax and loss run in float32. Under differentiation the gradients are
    computed in the forward pass, chunk by chunk. A traced label >= V counts as ignored.
    """
    check_rank("hidden", hidden, 2, "[N, H]")
    check_rank("kernel", kernel, 2, "[H, V]")
    check_rank("labels", labels, 1, "[N]")
    check_float("hidden", hidden)
    check_float("kernel", kernel)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"labels must hold integer ids, got dtype {labels.dtype}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    tokens, width = hidden.shape
    vocab = kernel.shape[1]
    if kernel.shape[0] != width:
        raise ValueError(f"kernel must have shape [H, V] with H = hidden's {width}, got {tuple(kernel.shape)}")
    if labels.shape[0] != tokens:
        raise ValueError(f"labels must have shape [N] = ({tokens},), got {tuple(labels.shape)}")
    if not isinstance(labels, jax.core.Tracer) and np.size(labels) and int(np.max(np.asarray(labels))) >= vocab:
        raise ValueError(f"labels hold id {int(np.max(np.asarray(labels)))}, outside the vocabulary of {vocab} ids")
    resolved = resolve_implementation(implementation, (hidden, kernel))
    if resolved != "reference" and jnp.promote_types(hidden.dtype, kernel.dtype) not in _KERNEL_DTYPES:
        if implementation == "auto":
            resolved = "reference"
        else:
            raise ValueError(
                f"implementation={implementation!r} takes bfloat16 or float32 logits, got hidden {hidden.dtype} "
                f"and kernel {kernel.dtype}: use implementation='auto' or 'reference'"
            )
    mask = (labels >= 0) & (labels < vocab)
    if where is not None:
        check_array("where", where, "[N]")
        if tuple(where.shape) != (tokens,) or where.dtype != jnp.bool_:
            raise ValueError(f"where must be a bool array of shape ({tokens},), got {where.dtype} {tuple(where.shape)}")
        mask = mask & where
    return _linear_cross_entropy(hidden, kernel, labels.astype(jnp.int32), mask, reduction, resolved)
