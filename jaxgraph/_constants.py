"""Constants a traced function closes over that should have been arguments.

A closed-over weight is baked into the executables (no gradient, later updates unseen); a
closed-over key freezes the dropout mask. A capture warns of both (`warn_constant_weights`,
`warn_constant_keys`), naming the fix.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import jax.extend as jex
import jax.numpy as jnp

from jaxgraph import rng as rng_lib


class ConstantWeightWarning(UserWarning):
  """A function given to `make_graphed` closes over a float array that feeds a matmul or a
  convolution: a weight baked into the executables, which gets no gradient and does not
  follow later updates of the array (docs/semantics.md, "Functions of their arguments",
  says which arrays count). Any size counts: a 16x16 weight trains no better as a constant
  than a large one, and a fixed matrix that is meant (a 3x3 colour transform, a Hadamard
  rotation) costs one warning per `make_graphed` call, where a missed weight costs a run.
  Where a fixed matrix is meant:
  `warnings.filterwarnings("ignore", category=jaxgraph.ConstantWeightWarning)`."""


# Operations through which a closed-over array is still that array on its way into a matmul
# (a weight is cast, transposed, reshaped or sliced first).
_WEIGHT_PATH = frozenset({
    "broadcast_in_dim", "convert_element_type", "copy", "copy_p", "dynamic_slice",
    "expand_dims", "reduce_precision", "reshape", "rev", "sharding_constraint", "slice",
    "squeeze", "transpose"})
# The operations that take a weight (the wgrad split finds the weight products by them too).
CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})


def constant_weights(closed: Any) -> list[str]:
  """Descriptions of the closed-over float arrays of a traced function that act as weights.

  An array counts when all of these hold: it is a constant of the jaxpr (an array the
  function closes over, not one it computes: a rotary table built from `iota` inside the
  function is not a constant), its dtype is a float (of any size), and it is an operand of
  a `dot_general` or a convolution, directly or through casts, transposes, reshapes and
  slices, also inside nested jits, `jax.checkpoint` and custom derivatives. Masks (bool,
  int) and tables used elementwise (rotary sin/cos, biases, a causal mask added to scores)
  are not weights.
  """
  return [description for description, _ in _constant_weight_arrays(closed)]


def _constant_weight_arrays(closed: Any) -> list[tuple[str, Any]]:
  """(description, array) of each weight `constant_weights` finds, in order."""
  found: dict[Any, tuple[str, Any]] = {}  # the constant's variable -> (description, array)

  # `tainted` maps a variable to the constant it carries: (its variable, (description, array))
  def visit(jaxpr: Any, tainted: dict[Any, tuple[Any, tuple[str, Any]]]) -> None:
    if isinstance(jaxpr, jex.core.ClosedJaxpr):
      tainted = {**tainted, **{
          var: (var, (f"{value.dtype}{list(value.shape)}", value))
          for var, value in zip(jaxpr.jaxpr.constvars, jaxpr.consts)
          if jnp.issubdtype(value.dtype, jnp.inexact)}}
      jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
      sources = [tainted.get(v) if isinstance(v, jex.core.Var) else None for v in eqn.invars]
      name = eqn.primitive.name
      if name in CONTRACTIONS:
        found.update(s for s in sources if s)
      elif name in _WEIGHT_PATH:
        if sources[0]:
          tainted[eqn.outvars[0]] = sources[0]
      else:  # a nested jaxpr may use a tainted operand, or close over arrays of its own
        for sub in subjaxprs(eqn):
          inner = sub.jaxpr if isinstance(sub, jex.core.ClosedJaxpr) else sub
          passed = len(inner.invars) == len(sources)  # operands passed on one to one
          visit(sub, {var: s for var, s in zip(inner.invars, sources) if s} if passed else {})

  visit(closed, {})
  return list(found.values())


def warn_constant_weights(closed: Any, name: str, warned: dict[int, Any]) -> None:
  """Warns of the closed-over weights of `closed` not in `warned` (ids of arrays warned of,
  the arrays kept so that no id is reused), and adds them: a weight is named once per
  `make_graphed` call, also where a fused chain or another signature traces it again."""
  weights = [(description, array) for description, array in _constant_weight_arrays(closed)
             if id(array) not in warned]
  if not weights:
    return
  warned.update((id(array), array) for _, array in weights)
  warnings.warn(
      f"{name}: the traced function closes over {len(weights)} float array(s) that feed a "
      f"matmul or a convolution ({', '.join(d for d, _ in weights)}). They are constants of "
      "the executables: the pullback returns no gradient for them, and changing them later "
      "does not change the graphed function. If they are weights, pass them as arguments "
      "(in sample_args and on every call; make_graphed(..., grad_mask=...) keeps frozen "
      "ones out of the backward). If they are meant to be fixed, silence this with "
      "warnings.filterwarnings('ignore', category=jaxgraph.ConstantWeightWarning).",
      ConstantWeightWarning, stacklevel=5)


def warn_constant_keys(closed: Any, name: str) -> None:
  frozen = constant_keys(closed)
  if frozen:
    warnings.warn(
        f"{name}: the traced function contains {frozen[0]}. A key that is a constant of the "
        "executable gives the same random numbers (the same dropout mask) on every replay. "
        "Take the key as an argument: make_graphed(..., rng=True) and fn(..., key=key).",
        stacklevel=5)


def subjaxprs(eqn: Any) -> Iterator[Any]:
  """The jaxprs nested in `eqn` (of a jit, `jax.checkpoint`, a custom derivative...)."""
  for value in eqn.params.values():
    items = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
      if isinstance(item, (jex.core.Jaxpr, jex.core.ClosedJaxpr)):
        yield item


def constant_keys(closed: Any) -> list[str]:
  """Descriptions of keys that are constants of a traced function (a frozen dropout mask).

  Finds key-typed constants (a key closed over by the function) and `random_seed` of a
  constant (`jax.random.key(0)` inside the function), also inside nested jaxprs.
  """
  found: list[str] = []

  def visit(jaxpr: Any) -> None:
    if isinstance(jaxpr, jex.core.ClosedJaxpr):
      found.extend(f"a closed-over key constant {c.dtype}{list(c.shape)}"
                   for c in jaxpr.consts if rng_lib.is_key(c))
      jaxpr = jaxpr.jaxpr
    constvars = set(jaxpr.constvars)
    for eqn in jaxpr.eqns:
      for var in eqn.invars:
        if isinstance(var, jex.core.Literal) and rng_lib.is_key(var.val):
          found.append(f"a key literal used by {eqn.primitive}")
      if eqn.primitive.name in ("random_seed", "random_wrap"):
        source = eqn.invars[0]
        if isinstance(source, jex.core.Literal) or source in constvars:
          found.append(f"{eqn.primitive.name} of a constant (jax.random.key(<constant>) "
                       "inside the function)")
      for sub in subjaxprs(eqn):
        visit(sub)

  visit(closed)
  return found
