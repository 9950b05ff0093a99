"""`make_graphed`'s argument checks: every argument checked before anything is traced.

One rule: an argument of the wrong type raises TypeError; of the right type but a bad value,
ValueError. Each message names the argument and says how to fix it. What passes comes back
normalized: one entry per callable (`Layers`), and the settings they share (`Config`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
import sys
import typing
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from jaxgraph import _graphed as graphed_lib
from jaxgraph import _hooks as hooks_lib
from jaxgraph import _pullback as pullback_lib
from jaxgraph import _signature as sig_lib
from jaxgraph import offload as offload_lib
from jaxgraph import rng as rng_lib
from jaxgraph import schedule as schedule_lib

# The platforms where `per_layer_executables=None` means True. XLA:GPU's command buffers
# re-record when one executable is called with other buffers (`_capture.loaded_copy`); on
# other backends a copy per layer gains nothing.
PER_LAYER_PLATFORMS = frozenset({"gpu"})


def _flax_module(fn: Any) -> str | None:
  """"NNX" or "Linen" where `fn` is a Flax module, or a method of an NNX module or of a bound
  Linen module: a callable that reads its weights from itself, not from its arguments.
  Flax is not imported here: a module exists only where the user imported it."""
  nnx, linen = sys.modules.get("flax.nnx"), sys.modules.get("flax.linen")
  owner = getattr(fn, "__self__", None)
  if nnx is not None and (isinstance(fn, nnx.Module) or isinstance(owner, nnx.Module)):
    return "NNX"
  if linen is not None and (isinstance(fn, linen.Module) or (
      isinstance(owner, linen.Module) and owner.scope is not None)):
    return "Linen"
  return None


def _refuse_flax_module(fn: Any, where: str) -> None:
  """A Flax module given as a layer function would be captured with its weights as
  constants of the executables: no gradient for them, and later updates unseen."""
  kind = _flax_module(fn)
  if kind is None:
    return
  split = ("fn, params = jaxgraph.flax.nnx_layer(module)" if kind == "NNX" else
           "fn, params = jaxgraph.flax.linen_layer(module, variables)")
  owner = getattr(fn, "__self__", None)
  what = (f"a method of a Flax {kind} module ({type(owner).__name__}.{fn.__name__})"
          if owner is not None else f"a Flax {kind} module ({type(fn).__name__})")
  raise TypeError(
      f"make_graphed got {what} as {where}. make_graphed captures functions of their "
      "arguments, and a module reads its weights from itself: they would become constants "
      "of the executables, the pullback would return no gradient for them, and updating "
      "the module would not change the graphed layer. Split it into a pure function and "
      f"its params first: {split}; then make_graphed(fn, sample_args=(params, x)) and "
      "layer.vjp(params, x) (docs/quickstart.md).")


def _as_callables(fns: Callable[..., Any] | Sequence[Callable[..., Any]]
                  ) -> tuple[list[Callable[..., Any]], bool]:
  if callable(fns):
    _refuse_flax_module(fns, "fns")
    return [fns], True
  if isinstance(fns, (str, bytes)) or not isinstance(fns, Sequence):
    raise TypeError(f"make_graphed takes a callable or a sequence of callables, got "
                    f"{type(fns).__name__}.")
  fns = list(fns)
  if not fns:
    raise ValueError("make_graphed got an empty sequence of callables; pass at least one.")
  for i, fn in enumerate(fns):
    if not callable(fn):
      raise TypeError(f"make_graphed: fns[{i}] is a {type(fn).__name__}, not a callable.")
    _refuse_flax_module(fn, f"fns[{i}]")
  return fns, False


def _per_callable_args(sample_args: Any, count: int, single: bool) -> list[tuple[Any, ...]]:
  if sample_args is None:
    raise TypeError("make_graphed needs sample_args: per callable, a tuple of its positional "
                    "arguments (arrays or jax.ShapeDtypeStruct).")
  if single:
    sample_args = [sample_args]
  if not isinstance(sample_args, Sequence):
    raise TypeError(f"sample_args takes one tuple of positional arguments per callable "
                    f"({count}), got {type(sample_args).__name__}.")
  if len(sample_args) != count:
    raise ValueError(f"make_graphed got {count} callables but sample_args has "
                     f"{len(sample_args)} entries; pass one tuple of positional arguments per "
                     "callable.")
  out = []
  for i, args in enumerate(sample_args):
    if not isinstance(args, (tuple, list)):
      raise TypeError(f"sample_args[{i}] must be a tuple of positional arguments, got "
                      f"{type(args).__name__}; for one argument write (x,).")
    out.append(tuple(args))
  return out


# Without `order`: one chunk holding every layer, one microbatch.
NO_ORDER = schedule_lib.parse_order([1, -1])


def _pipeline_args(sample_args: Any, single: bool, sizes: Sequence[int], microbatches: int
                   ) -> tuple[list[tuple[Any, ...]], list[list[tuple[Any, ...]]]]:
  """With `order`: the sample_args as given (flat) and per layer, per microbatch.

  Takes one tuple per layer (every microbatch uses it) or Transformer Engine's one tuple per
  (chunk, microbatch, layer), chunk-major; both are the same for one microbatch.
  """
  layers = sum(sizes)
  if single:
    return _per_callable_args(sample_args, 1, True), [[tuple(sample_args)] * microbatches]
  if not isinstance(sample_args, Sequence):
    raise TypeError(f"with order=..., sample_args takes a sequence of tuples of positional "
                    f"arguments, got {type(sample_args).__name__}.")
  entries = len(sample_args)
  if entries not in (layers, layers * microbatches):
    raise ValueError(
        f"with order=..., sample_args takes one tuple per layer ({layers}) or, as Transformer "
        f"Engine, one per (chunk, microbatch, layer) ({layers} * {microbatches} = "
        f"{layers * microbatches}), but got {entries}.")
  flat = _per_callable_args(sample_args, entries, False)
  if entries == layers:
    return flat, [[args] * microbatches for args in flat]
  per_microbatch: list[list[tuple[Any, ...]]] = []
  position = 0
  for size in sizes:
    rows: list[list[tuple[Any, ...]]] = [[] for _ in range(size)]
    for _ in range(microbatches):
      for row in rows:
        row.append(flat[position])
        position += 1
    per_microbatch.extend(rows)
  return flat, per_microbatch


def _per_callable_flags(value: bool | Sequence[bool], count: int, argument: str) -> list[bool]:
  """One bool per callable from one bool for all, or a sequence of `count` bools."""
  if isinstance(value, bool):
    return [value] * count
  message = f"{argument} takes a bool or one bool per callable ({count}), got {value!r}."
  if (not isinstance(value, Sequence) or isinstance(value, (str, bytes))
      or not all(isinstance(flag, bool) for flag in value)):
    raise TypeError(message)
  if len(value) != count:
    raise ValueError(message)
  return list(value)


def _check_bool(name: str, value: Any) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {value!r}.")
  return bool(value)


def _check_int(name: str, value: Any, *, minimum: int) -> int:
  """`value` as a count: an int (not a bool) >= `minimum`."""
  message = f"{name} must be an int >= {minimum}, got {value!r}."
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise TypeError(message)
  if value < minimum:
    raise ValueError(message)
  return int(value)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
  if not isinstance(value, str):
    raise TypeError(f"{name} must be one of {choices}, got {value!r}.")
  if value not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {value!r}.")
  return value


def _check_callable(name: str, value: Any, what: str) -> None:
  """`value` is None or callable; `what` says which callable (in the error)."""
  if value is not None and not callable(value):
    raise TypeError(f"{name} must be {what}, got {value!r}.")


def _check_argnums(name: str, value: Any, example: str) -> tuple[int, ...]:
  """`value` as a tuple of positional argument indices: a sequence of ints (not bools).
  Their range is checked against the sample_args by the caller."""
  if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
    raise TypeError(f"{name} must be a sequence of ints, e.g. {example}, got {value!r}.")
  argnums = tuple(value)
  bad = [a for a in argnums if isinstance(a, bool) or not isinstance(a, int)]
  if bad:
    raise TypeError(f"{name} must hold ints (positional argument indices), got {bad[0]!r} in "
                    f"{argnums}.")
  return argnums


def _check_wgrad_argnums(wgrad_argnums: Any, samples: Sequence[tuple[Any, ...]], *,
                         delay_wgrad: bool) -> tuple[int, ...]:
  argnums = _check_argnums("wgrad_argnums", wgrad_argnums, "(0,)")
  if any(a < 0 for a in argnums):
    raise ValueError(f"wgrad_argnums must be non-negative ints, got {argnums!r}.")
  for i, args in enumerate(samples):
    if delay_wgrad and any(argnum >= len(args) for argnum in argnums):
      raise ValueError(f"wgrad_argnums={argnums} but sample_args[{i}] has only "
                       f"{len(args)} positional arguments.")
  return argnums


def _check_inference_only(inference_only: Any, *, delay_wgrad: bool,
                          order: Sequence[float] | None, offload: bool,
                          remat_policy: Callable[..., bool] | None, grad_mask: Any) -> bool:
  _check_bool("inference_only", inference_only)
  conflicts = [name for name, given in (("delay_wgrad", delay_wgrad),
                                        ("offload_residuals", offload),
                                        ("order", order is not None),
                                        ("remat_policy", remat_policy is not None),
                                        ("grad_mask", grad_mask is not None)) if given]
  if inference_only and conflicts:
    raise ValueError(
        f"make_graphed got inference_only=True together with {' and '.join(conflicts)}, "
        "which only concern a backward (an inference-only callable has none). Drop "
        f"{' and '.join(conflicts)}, or drop inference_only to train.")
  return inference_only


def _check_donate_argnums(donate_argnums: Any, samples: Sequence[tuple[Any, ...]],
                          *, inference_only: bool) -> tuple[int, ...]:
  argnums = _check_argnums("donate_argnums", donate_argnums, "(2,)")
  if not argnums:
    return argnums
  if not inference_only:
    raise ValueError(
        f"make_graphed got donate_argnums={argnums} without inference_only=True: a training "
        "forward's inputs are needed again by its backward, so they cannot be donated. Pass "
        "inference_only=True (a decode step), or drop donate_argnums.")
  if len(set(argnums)) != len(argnums):
    raise ValueError(f"donate_argnums={argnums} lists an argument more than once; list each "
                     "donated positional argument once.")
  for i, args in enumerate(samples):
    outside = [a for a in argnums if not 0 <= a < len(args)]
    if outside:
      raise ValueError(
          f"donate_argnums={argnums} has {outside[0]}, but sample_args[{i}] has "
          f"{len(args)} positional arguments: each index must be in range(0, {len(args)}).")
  return argnums


def _check_grad_mask(grad_mask: Any, samples: Sequence[tuple[Any, ...]]) -> None:
  """`grad_mask` fits every callable's sample_args (a callable mask is called with their
  `jax.ShapeDtypeStruct`s, as at every capture)."""
  for i, args in enumerate(samples):
    try:
      pullback_lib.mask_flags(grad_mask, sig_lib.abstract_tree(args))
    except (TypeError, ValueError) as e:
      raise type(e)(f"grad_mask, for sample_args[{i}]: {e}") from None


def _check_sample_leaves(samples: Sequence[tuple[Any, ...]]) -> None:
  """Every sample_args leaf is an array or a ShapeDtypeStruct (a signature can be taken),
  and none is a tracer (make_graphed called under a JAX transformation)."""
  for i, args in enumerate(samples):
    leaves, treedef = jax.tree.flatten(args)
    traced = [path for path, leaf in zip(sig_lib.leaf_paths(treedef), leaves)
              if isinstance(leaf, jax.core.Tracer)]
    if traced:
      raise TypeError(
          f"sample_args[{i}]: argument {traced[0]} is a tracer: make_graphed was called "
          "inside jax.jit, jax.grad or jax.vmap (or given a traced value). make_graphed runs "
          "outside JAX transformations, on concrete sample_args (arrays or "
          "jax.ShapeDtypeStructs): call it once before your jitted step, and call the "
          "graphed callables inside it (under a transformation they run the function).")
    try:
      sig_lib.signature_of(leaves, treedef)
    except TypeError as e:
      raise TypeError(f"sample_args[{i}]: {e}") from None


def _check_key_parameter(fns: Sequence[Callable[..., Any]],
                         samples: Sequence[tuple[Any, ...]], *, rng: bool) -> None:
  """A function that needs `key=` has rng=True, and one given rng=True takes `key=`.

  Judged by binding the sample_args with and without `key=` to the function's signature:
  only a call that binds one way and not the other is refused (a function without a
  signature to read, or that fails both ways, is left to its trace).
  """
  for i, (fn, args) in enumerate(zip(fns, samples)):
    try:
      signature = inspect.signature(fn)
    except (TypeError, ValueError):
      continue

    def binds(**key: Any) -> bool:
      try:
        signature.bind(*args, **key)
      except TypeError:
        return False
      return True

    name = f"{getattr(fn, '__name__', type(fn).__name__)} (fns[{i}])"
    if not rng and binds(key=None) and not binds():
      raise TypeError(
          f"{name} takes a key= parameter, but make_graphed was called without rng=True, "
          "so no key would be passed. Pass make_graphed(..., rng=True): each forward then "
          "gets a fresh key and its backward the same one (docs/rng.md).")
    if rng and binds() and not binds(key=None):
      raise TypeError(
          f"make_graphed got rng=True, which calls every function with key=..., but {name} "
          f"has no key parameter. Add one (def {getattr(fn, '__name__', 'fn')}(params, x, "
          "*, key)), or drop rng=True.")


def seed_of(rng: Any) -> jax.Array | None:
  """The key every callable's stream starts from: None without rng, `key(0)` for True."""
  if isinstance(rng, bool):
    return jax.random.key(0) if rng else None
  rng_lib.check_key(rng, "make_graphed(rng=...)")
  return rng


def _check_compiler_options(value: Any) -> tuple[tuple[str, Any], ...]:
  """The options as sorted (name, value) pairs, each checked by XLA now: a name XLA does not
  know, or a value it cannot parse for that option, raises before anything is traced."""
  if value is None:
    return ()
  if not isinstance(value, Mapping) or not all(
      isinstance(k, str) and isinstance(v, (bool, int, float, str)) for k, v in value.items()):
    raise TypeError(
        "compiler_options takes a dict of XLA option names (as in XLA_FLAGS, without the "
        "leading --) to bool, int, float or str values, e.g. compiler_options="
        f"{{'xla_gpu_graph_min_graph_size': 1}}, or None; got {value!r}.")
  options = tuple(sorted(value.items()))
  _check_options_with_xla(options, jax.default_backend())
  return options


@functools.lru_cache(maxsize=64)
def _check_options_with_xla(options: tuple[tuple[str, Any], ...], backend: str) -> None:
  """Compiles a trivial function with `options` (XLA parses them at compile time only)."""
  del backend  # part of the cache key: the options are checked by that backend's compiler
  lowered = jax.jit(lambda x: x + 1).lower(np.float32(0))
  for name, option in options:
    try:
      lowered.compile({name: option})
    except jax.errors.JaxRuntimeError as e:
      raise ValueError(
          f"compiler_options: XLA refuses {name}={option!r} ({e}). Pass a name of XLA's "
          "DebugOptions (the flags XLA_FLAGS takes, without the leading --) with a value of "
          "its type: a bool for a flag, a comma-separated str for a list (e.g. "
          "'FUSION,CUBLAS'), an enum value's name as a str.") from None


def _check_per_layer_executables(value: Any) -> bool:
  """None means: on where the default backend is one of `PER_LAYER_PLATFORMS`."""
  if value is None:
    return jax.default_backend() in PER_LAYER_PLATFORMS
  return _check_bool("per_layer_executables", value)


@dataclasses.dataclass(frozen=True)
class Layers:
  """What `make_graphed` builds its callables from, per callable, checked."""

  fns: list[Callable[..., Any]]
  single: bool  # one callable given (not a sequence): one GraphedCallable returned
  parsed: schedule_lib.ParsedOrder  # the order (without `order`: every forward, every backward)
  sizes: tuple[int, ...]  # layers per chunk of the order
  samples: list[list[tuple[Any, ...]]]  # [layer][microbatch] -> its sample_args
  flat_samples: list[tuple[Any, ...]]  # sample_args as given, one tuple per entry
  offload: list[bool]
  hooks: tuple[hooks_lib.Hooks, ...]
  capture_time_hooks: tuple[hooks_lib.Hooks, ...]


def check_layers(fns: Any, hooks: Any, capture_time_hooks: Any, sample_args: Any,
                 order: Sequence[float] | None, num_layers_per_chunk: Any, *,
                 delay_wgrad: bool, offload_residuals: Any) -> Layers:
  """Step 1a: the callables and their per-callable arguments (sample_args in the shape the
  order asks for, offload flags, hooks), checked and one entry per callable."""
  fn_list, single = _as_callables(fns)
  count = len(fn_list)
  _check_bool("delay_wgrad", delay_wgrad)
  if order is None:
    if num_layers_per_chunk is not None:
      raise ValueError("num_layers_per_chunk only applies with order=[...]; drop it, or pass "
                       "the pipeline order.")
    flat = _per_callable_args(sample_args, count, single)
    parsed, sizes, samples = NO_ORDER, (count,), [[args] for args in flat]
  else:
    parsed = schedule_lib.parse_order(order, delay_wgrad=delay_wgrad)
    sizes = schedule_lib.layers_per_chunk(num_layers_per_chunk, parsed.num_chunks, count)
    flat, samples = _pipeline_args(sample_args, single, sizes, parsed.num_microbatches)
  return Layers(fn_list, single, parsed, tuple(sizes), samples, flat,
                offload=_per_callable_flags(offload_residuals, count, "offload_residuals"),
                hooks=hooks_lib.per_callable(hooks, count, "hooks"),
                capture_time_hooks=hooks_lib.per_callable(capture_time_hooks, count,
                                                           "capture_time_hooks"))


def check_offload(offloaded: bool, mode: Any, min_bytes: Any,
                  names: Any) -> offload_lib.Policy:
  """The offload policy: its mode, and which kept residuals of an offloaded layer move."""
  _check_choice("offload_mode", mode, offload_lib.MODES)
  _check_int("offload_min_bytes", min_bytes, minimum=0)
  if names is not None:
    if (not isinstance(names, Sequence) or isinstance(names, (str, bytes))
        or not all(isinstance(n, str) for n in names)):
      raise TypeError(f"offload_names takes a sequence of checkpoint_name strings, e.g. "
                      f"offload_names=('matmul_input',), or None; got {names!r}.")
    if not names:
      raise ValueError("offload_names=() selects no residual; pass None to offload every "
                       "residual of the offloaded layers, or offload_residuals=False.")
  if not offloaded and (min_bytes or names is not None):
    raise ValueError("offload_min_bytes and offload_names choose residuals of the offloaded "
                     "layers, but offload_residuals offloads none; pass offload_residuals="
                     "True (or one bool per callable), or drop them.")
  return offload_lib.Policy(mode, int(min_bytes),
                            None if names is None else frozenset(names))


def check_config(layers: Layers, order: Sequence[float] | None, *, rng: bool,
                 delay_wgrad: bool, wgrad_argnums: Any, max_captures: Any,
                 on_new_signature: Any, remat_policy: Any, inference_only: Any,
                 donate_argnums: Any, per_layer_executables: Any, grad_mask: Any,
                 offload: offload_lib.Policy, compiler_options: Any) -> graphed_lib.Config:
  """Step 1b: the settings every callable shares, checked against the sample_args."""
  _check_int("max_captures", max_captures, minimum=1)
  _check_choice("on_new_signature", on_new_signature,
                typing.get_args(graphed_lib.OnNewSignature))
  _check_callable("remat_policy", remat_policy, "a jax.checkpoint policy (a callable, e.g. "
                  "jaxgraph.residuals.recompute_elementwise) or None")
  if any(layers.offload):  # first: the sample checks below already ask the backend
    offload_lib.check_backend_supports_offload()
  wgrad = _check_wgrad_argnums(wgrad_argnums, layers.flat_samples, delay_wgrad=delay_wgrad)
  _check_sample_leaves(layers.flat_samples)
  _check_key_parameter(layers.fns, [rows[0] for rows in layers.samples], rng=rng)
  inference_only = _check_inference_only(inference_only, delay_wgrad=delay_wgrad, order=order,
                                         offload=any(layers.offload), remat_policy=remat_policy,
                                         grad_mask=grad_mask)
  donated = _check_donate_argnums(donate_argnums, layers.flat_samples,
                                  inference_only=inference_only)
  _check_grad_mask(grad_mask, layers.flat_samples)
  return graphed_lib.Config(rng=rng, delay_wgrad=delay_wgrad, wgrad_argnums=wgrad,
                            max_captures=max_captures, on_new_signature=on_new_signature,
                            inference_only=inference_only, remat_policy=remat_policy,
                            donate_argnums=donated,
                            per_layer_executables=_check_per_layer_executables(
                                per_layer_executables), offload=offload, grad_mask=grad_mask,
                            compiler_options=_check_compiler_options(compiler_options))


def check_warmup(num_warmup_iters: Any, pre_warmup_hook: Any, post_warmup_hook: Any) -> int:
  """Step 1c: the warmup's iteration count and its two hooks."""
  for name, hook in (("pre_warmup_hook", pre_warmup_hook),
                     ("post_warmup_hook", post_warmup_hook)):
    _check_callable(name, hook, "a callable taking no arguments")
  return _check_int("num_warmup_iters", num_warmup_iters, minimum=0)
