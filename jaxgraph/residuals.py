"""Which intermediates cross from a forward executable to its backward.

Inside one whole-step `jax.jit`, XLA fuses cheap elementwise producers into their consumers
on both sides of the gradient, so a LayerNorm's float32 intermediates or a GELU's input are
never written out: the backward recomputes them from the bf16 values it reads anyway. Across
the host boundary between a jaxgraph forward and backward nothing is fused, and every such
intermediate becomes a residual written by the forward and read by the backward.

`recompute_elementwise` is a `jax.checkpoint` policy that restores what XLA does inside one
executable: the outputs of matmuls, attention kernels, reductions, random bits and
comparisons (1-byte masks) are saved; elementwise arithmetic and layout changes are
recomputed in the backward from them. Values named with `jax.ad_checkpoint.checkpoint_name`
are saved too: name an elementwise result the forward writes out anyway (a matmul's input,
such as a norm's output or an activation) to keep it rather than recompute it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RECOMPUTED", "recompute_elementwise"]

# Primitives whose outputs are recomputed: elementwise arithmetic, casts and layout changes.
# Comparisons stay saved: a bool mask (dropout) costs one byte an element, the values it was
# computed from four. `sharding_constraint` is recomputed so no gathered FSDP weight is saved.
RECOMPUTED = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh",
    "bitcast_convert_type", "broadcast_in_dim", "cbrt", "ceil", "clamp", "concatenate", "conj",
    "convert_element_type", "copy", "copy_p", "cos", "cosh", "div", "erf", "erf_inv", "erfc",
    "exp", "exp2", "expand_dims", "expm1", "floor", "imag", "integer_pow", "iota", "is_finite",
    "log", "log1p", "logistic", "max", "min", "mul", "neg", "not", "or", "pad", "pow", "real",
    "reduce_precision", "rem", "reshape", "rev", "round", "rsqrt", "select_n",
    "sharding_constraint", "shift_left", "shift_right_arithmetic", "shift_right_logical",
    "sign", "sin", "sinh", "slice", "sqrt", "square", "squeeze", "sub", "tan", "tanh",
    "transpose", "xor",
})


def recompute_elementwise(prim: Any, *avals: Any, **params: Any) -> bool:
  """A `jax.checkpoint` policy: True (save) unless `prim` is elementwise or a layout change.

  Pass it as `make_graphed(..., remat_policy=jaxgraph.residuals.recompute_elementwise)`.
  """
  del avals, params
  return prim.name not in RECOMPUTED
