"""`make_graphed`: argument checks, building GraphedCallables, capture and warmup.

`make_graphed` runs four steps in order: check every argument (before anything is traced or
a hook fires), build one GraphedCallable per callable, capture (trace and compile each
distinct signature once), warm up. Capture and warmup run under `hooks.capturing()`, so
`is_capturing()` is True inside them and False again however they end.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
import sys
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgraph import graphed as graphed_lib
from jaxgraph import hooks as hooks_lib
from jaxgraph import offload as offload_lib
from jaxgraph import pullback as pullback_lib
from jaxgraph import rng as rng_lib
from jaxgraph import schedule as schedule_lib
from jaxgraph import signature as sig_lib

_ON_NEW_SIGNATURE = ("capture", "error")

# The platforms where `per_layer_executables=None` means True. XLA:GPU's command buffers
# re-record when one executable is called with other buffers (`capture.loaded_copy`); on
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
_NO_ORDER = schedule_lib.parse_order([1, -1])


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


def _materialize(leaf: Any) -> Any:
  """Concrete warmup data for a sample leaf: arrays as given, zeros for ShapeDtypeStructs."""
  if isinstance(leaf, jax.ShapeDtypeStruct):
    zeros = jnp.zeros(leaf.shape, leaf.dtype)
    return zeros if leaf.sharding is None else jax.device_put(zeros, leaf.sharding)
  return leaf


def _fresh(args: tuple[Any, ...], donate_argnums: tuple[int, ...]) -> tuple[Any, ...]:
  """`args` with copies of the donated arguments: a warmup forward consumes those, and
  must not consume the caller's sample arrays (or the next iteration's data)."""
  return tuple(jax.tree.map(jnp.copy, arg) if argnum in donate_argnums else arg
               for argnum, arg in enumerate(args))


def _abstract_tree(tree: Any) -> Any:
  return jax.tree.map(lambda leaf: sig_lib.abstract(sig_lib.leaf_spec(leaf)), tree)


def _ones_like(tree: Any) -> Any:
  return jax.tree.map(lambda leaf: jnp.ones_like(leaf), tree)


def _steps(plan: schedule_lib.Plan, sizes: Sequence[int], *, inference_only: bool
           ) -> list[tuple[str, int, int]]:
  """`(kind, layer, microbatch)` of `plan`; its forwards only for inference-only layers."""
  return [step for step in schedule_lib.layer_steps(plan, sizes)
          if not inference_only or step[0] == "forward"]


def _capture_all(layers: Sequence[graphed_lib.GraphedCallable],
                 samples: Sequence[Sequence[tuple[Any, ...]]], plan: schedule_lib.Plan,
                 sizes: Sequence[int], *, inference_only: bool) -> None:
  """Step 3, capture: in the order of `plan` (without `order`: every forward in order, every
  backward in reverse; `inference_only`: the forwards only), hooks around each;
  `samples[i][m]` are the args of layer i at microbatch m. Wgrad entries fire no hooks
  (Transformer Engine's rule)."""
  outputs = {}
  for kind, i, m in _steps(plan, sizes, inference_only=inference_only):
    layer, args = layers[i], samples[i][m]
    if kind == "forward":
      leaves, treedef = jax.tree.flatten(args)
      signature = sig_lib.signature_of(leaves, treedef)
      hooks = layer._hooks["capture"]
      pre, post = hooks.pre_forward, hooks.forward
      event = hooks_lib.HookEvent(layer.index, "capture", 0, m, _abstract_tree(args))
      hooks_lib.fire(pre, "pre_forward", event, layer.name)
      try:
        entry = layer._entry(signature, sampled=True)
      except Exception as e:
        e.add_note(f"while capturing {layer.name} from sample_args[{layer.index}]")
        raise
      layout = entry.layout
      out = jax.tree.unflatten(layout.out_treedef, layout.out_specs)
      outputs[i, m] = (event.args, out)
      hooks_lib.fire(post, "forward", hooks_lib.HookEvent(
          layer.index, "capture", 0, m, event.args, outputs=out), layer.name)
    elif kind == "backward":
      abstract_args, out = outputs.pop((i, m))
      hooks = layer._hooks["capture"]
      pre, post = hooks.pre_backward, hooks.backward
      event = hooks_lib.HookEvent(layer.index, "capture", 0, m, abstract_args,
                                  outputs=out, cotangents=out)
      hooks_lib.fire(pre, "pre_backward", event, layer.name)
      hooks_lib.fire(post, "backward", hooks_lib.HookEvent(
          layer.index, "capture", 0, m, abstract_args, outputs=out, cotangents=out,
          grads=abstract_args), layer.name)


def _warmup(layers: Sequence[graphed_lib.GraphedCallable],
            samples: Sequence[Sequence[tuple[Any, ...]]], plan: schedule_lib.Plan,
            sizes: Sequence[int], iterations: int, *, rng: bool, delay_wgrad: bool,
            inference_only: bool, donate_argnums: tuple[int, ...]) -> None:
  """Warmup phase: replays the order of `plan` exactly (without `order`: all forwards, then
  all backwards in reverse; `inference_only`: the outputs-only forwards alone); a wgrad
  without its own order entry runs right after its backward. Results are discarded; each
  forward gets fresh copies of the `donate_argnums` arguments."""
  materialized: dict[int, Any] = {}  # one-per-layer sample_args repeat across microbatches
  data = [[materialized.setdefault(id(args), jax.tree.map(_materialize, args)) for args in row]
          for row in samples]
  base = rng_lib.warmup_base() if rng else None
  results = []
  for iteration in range(iterations):
    stream = (base, jnp.uint32(iteration)) if rng else None
    pending = {}
    for kind, i, m in _steps(plan, sizes, inference_only=inference_only):
      layer, args = layers[i], data[i][m]
      if kind == "forward":
        if donate_argnums:
          args = _fresh(args, donate_argnums)
        leaves, treedef = jax.tree.flatten(args)
        pending[i, m] = layer._forward(args, leaves, treedef, None, phase="warmup",
                                       iteration=iteration, microbatch=m,
                                       with_pullback=not inference_only, stream=stream)
        results.append(pending[i, m][0])
      elif kind == "backward":
        out, pullback = pending[i, m] if plan.has_wgrad else pending.pop((i, m))
        results.append(pullback(_ones_like(out)))
        if delay_wgrad and not plan.has_wgrad:
          results.append(pullback.wgrad())
      else:
        results.append(pending.pop((i, m))[1].wgrad())
  jax.block_until_ready(results)


# ------------------------------------------------------------------------ argument checks
# One rule: an argument of the wrong type raises TypeError; of the right type but a bad value,
# ValueError. Each message names the argument.


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
      pullback_lib.mask_flags(grad_mask, _abstract_tree(args))
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


def _seed(rng: Any) -> jax.Array | None:
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


# ------------------------------------------------------------------------ make_graphed steps


@dataclasses.dataclass(frozen=True)
class _Layers:
  """What `make_graphed` builds its callables from, per callable, checked."""

  fns: list[Callable[..., Any]]
  single: bool  # one callable given (not a sequence): one GraphedCallable returned
  plan: schedule_lib.Plan  # the order (without `order`: every forward, every backward)
  sizes: tuple[int, ...]  # layers per chunk of the order
  samples: list[list[tuple[Any, ...]]]  # [layer][microbatch] -> its sample_args
  flat_samples: list[tuple[Any, ...]]  # sample_args as given, one tuple per entry
  offload: list[bool]
  hooks: tuple[hooks_lib.Hooks, ...]
  capture_time_hooks: tuple[hooks_lib.Hooks, ...]


def _check_layers(fns: Any, hooks: Any, capture_time_hooks: Any, sample_args: Any,
                  order: Sequence[float] | None, num_layers_per_chunk: Any, *,
                  delay_wgrad: bool, offload_residuals: Any) -> _Layers:
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
    plan, sizes, samples = _NO_ORDER, (count,), [[args] for args in flat]
  else:
    plan = schedule_lib.parse_order(order, delay_wgrad=delay_wgrad)
    sizes = schedule_lib.layers_per_chunk(num_layers_per_chunk, plan.num_chunks, count)
    flat, samples = _pipeline_args(sample_args, single, sizes, plan.num_microbatches)
  return _Layers(fn_list, single, plan, tuple(sizes), samples, flat,
                 offload=_per_callable_flags(offload_residuals, count, "offload_residuals"),
                 hooks=hooks_lib.per_callable(hooks, count, "hooks"),
                 capture_time_hooks=hooks_lib.per_callable(capture_time_hooks, count,
                                                           "capture_time_hooks"))


def _check_offload(offloaded: bool, mode: Any, min_bytes: Any,
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


def _check_config(layers: _Layers, order: Sequence[float] | None, *, rng: bool,
                  delay_wgrad: bool, wgrad_argnums: Any, max_captures: Any,
                  on_new_signature: Any, remat_policy: Any, inference_only: Any,
                  donate_argnums: Any, per_layer_executables: Any, grad_mask: Any,
                  offload: offload_lib.Policy, compiler_options: Any) -> graphed_lib.Config:
  """Step 1b: the settings every callable shares, checked against the sample_args."""
  _check_int("max_captures", max_captures, minimum=1)
  _check_choice("on_new_signature", on_new_signature, _ON_NEW_SIGNATURE)
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


def _check_warmup(num_warmup_iters: Any, pre_warmup_hook: Any, post_warmup_hook: Any) -> int:
  """Step 1c: the warmup's iteration count and its two hooks."""
  for name, hook in (("pre_warmup_hook", pre_warmup_hook),
                     ("post_warmup_hook", post_warmup_hook)):
    _check_callable(name, hook, "a callable taking no arguments")
  return _check_int("num_warmup_iters", num_warmup_iters, minimum=0)


def _build_callables(layers: _Layers, config: graphed_lib.Config,
                     seed: jax.Array | None) -> list[graphed_lib.GraphedCallable]:
  """Step 2: one GraphedCallable per callable, sharing `config` (and so its executable
  cache); with a seed, every key stream starts from it. Nothing is traced yet."""
  built = [graphed_lib.GraphedCallable(fn, i, config, hooks=layers.hooks[i],
                                       capture_time_hooks=layers.capture_time_hooks[i],
                                       offload=layers.offload[i])
           for i, fn in enumerate(layers.fns)]
  if seed is not None:
    for layer in built:
      layer.seed(seed)
  return built


def _warmup_between_hooks(built: Sequence[graphed_lib.GraphedCallable], layers: _Layers,
                          config: graphed_lib.Config, iterations: int,
                          pre_warmup_hook: Callable[[], None] | None,
                          post_warmup_hook: Callable[[], None] | None) -> None:
  """Step 4: `iterations` warmup iterations between the two warmup hooks. Once
  `pre_warmup_hook` returned, `post_warmup_hook` runs also when the warmup raises (a user
  who turns something off in one and back on in the other is not left switched off)."""
  if pre_warmup_hook is not None:
    pre_warmup_hook()
  try:
    _warmup(built, layers.samples, layers.plan, layers.sizes, iterations, rng=config.rng,
            delay_wgrad=config.delay_wgrad, inference_only=config.inference_only,
            donate_argnums=config.donate_argnums)
  except BaseException as error:
    if post_warmup_hook is not None:
      try:
        post_warmup_hook()
      except Exception as hook_error:  # the warmup's error is the one to see
        error.add_note(f"post_warmup_hook raised too, after it: {hook_error!r}")
    raise
  if post_warmup_hook is not None:
    post_warmup_hook()


def make_graphed(
    fns: Callable[..., Any] | Sequence[Callable[..., Any]],
    hooks: hooks_lib.Hooks | Sequence[hooks_lib.Hooks | None] | None = None,
    *,
    sample_args: Any,
    capture_time_hooks: hooks_lib.Hooks | Sequence[hooks_lib.Hooks | None] | None = None,
    num_warmup_iters: int = 3,
    pre_warmup_hook: Callable[[], None] | None = None,
    post_warmup_hook: Callable[[], None] | None = None,
    rng: bool | jax.Array = False,
    order: Sequence[float] | None = None,
    num_layers_per_chunk: int | Sequence[int] | None = None,
    delay_wgrad: bool = False,
    wgrad_argnums: Sequence[int] = (0,),
    grad_mask: Any = None,
    offload_residuals: bool | Sequence[bool] = False,
    offload_mode: offload_lib.Mode = "async",
    offload_min_bytes: int = 0,
    offload_names: Sequence[str] | None = None,
    max_captures: int = 8,
    on_new_signature: graphed_lib.OnNewSignature = "capture",
    remat_policy: Callable[..., bool] | None = None,
    inference_only: bool = False,
    donate_argnums: Sequence[int] = (),
    per_layer_executables: bool | None = None,
    compiler_options: Mapping[str, bool | int | float | str] | None = None,
) -> graphed_lib.GraphedCallable | tuple[graphed_lib.GraphedCallable, ...]:
  """Captures per-layer functions into ahead-of-time compiled forward/backward executables.

  Each distinct (function, input signature) is traced once and compiled into a forward and a
  backward executable (dgrad + wgrad with `delay_wgrad`); identical callables share them.
  Then every callable is warmed up `num_warmup_iters` times. Hooks run on the host. With
  `inference_only=True` (a decode step), only the forward a plain call replays is compiled.

  Args:
    fns: a callable, or a sequence of callables (one per layer). Each is a pure function of
      its positional arguments (and `key=` when `rng` is set) returning a pytree of arrays.
    hooks: replay-time hooks (`jaxgraph.Hooks`, one for all, or one per callable); they fire
      in warmup, capture and every replay.
    sample_args: per callable, a tuple of its positional arguments (arrays or
      `jax.ShapeDtypeStruct`s); for a single callable, just that tuple. With `order`, also
      Transformer Engine's form: one tuple per (chunk, microbatch, layer), chunk-major.
    capture_time_hooks: hooks that fire in warmup and capture only, never on replay
      (Transformer Engine's `capture_time_hooks`).
    num_warmup_iters: warmup iterations after capture (all forwards, then all backwards in
      reverse; with `order`, exactly the order); their results are discarded and no key
      stream advances.
    pre_warmup_hook: called once (not per callable) before the whole warmup, no arguments.
    post_warmup_hook: called once after the whole warmup, no arguments; also when the
      warmup raises, once `pre_warmup_hook` returned (a pair that turns something off and
      back on leaves it on).
    rng: True to thread PRNG keys: each function takes `key=`; False for none; or a typed key
      to seed every callable's stream (True seeds with `jax.random.key(0)`).
    order: a pipeline schedule (Transformer Engine's `_order`, docs/pipeline.md): `c` runs
      the forwards of chunk c (1-based) for its next microbatch, `-c` their backwards (layers
      reversed), `-c - 0.5` their deferred wgrads (`delay_wgrad`). The callables are the
      layers of chunk 1, then chunk 2, ...; warmup and capture follow the order, and hooks
      report each microbatch. Executables are still shared across microbatches.
    num_layers_per_chunk: with `order`, the layers of each chunk: an int, or one int per
      chunk for uneven pipelines; None splits the callables evenly.
    delay_wgrad: split each backward into dgrad (returned by the pullback) and wgrad
      (`pullback.wgrad()`), as separate executables.
    wgrad_argnums: the positional arguments that are weights (for `delay_wgrad`).
    grad_mask: which argument leaves get gradients, as torch's `requires_grad` and optax's
      masks: a pytree prefix of the positional arguments with bool leaves (True:
      differentiated), each covering the subtree it sits over: `(False, True)` for no
      gradient of the first argument, `({"w": False, "lora": True}, True)` for a frozen
      weight `w`, `jaxgraph.flat.mask(...)` over a FlatTree's groups. Or a function of
      the positional arguments returning one (called with `jax.ShapeDtypeStruct`s at
      capture, with the arguments under a JAX transformation). One mask for every
      callable. The backward computes nothing for a leaf the mask leaves out (no weight
      gradient matmul, and the forward keeps no residual only that gradient would read);
      its gradient is a float0 zero, as an integer leaf's is (`jax.vjp`), which no
      optimizer takes: `jaxgraph.partition` splits params and grads by the same mask so
      that Optax goes over the trainable part. Under a user's transformation those leaves
      are `jax.lax.stop_gradient`ed. None (the default): every float leaf.
    offload_residuals: keep forward residuals in pinned host memory until the backward; a bool
      or one bool per callable (`jaxgraph.offload.plan` picks them from measured times).
      Results are bitwise those without offload (docs/offload.md).
    offload_mode: how residuals travel. "async": the host starts each copy to host memory
      as the forward is enqueued and each copy back a layer ahead of its backward
      (`Pullback.prefetch`), so both overlap other layers' compute; the executables are
      those without offload. "executable": the forward executable writes them to host
      memory and the backward executable reads them back, serial with each.
    offload_min_bytes: offload only the kept buffers of at least this many bytes (small
      residuals travel packed into one buffer per dtype; `Stats.offload_bytes` reports
      what moves).
    offload_names: offload only the residuals named one of these with
      `jax.ad_checkpoint.checkpoint_name` (with `remat_policy`, saved named values); None:
      named or not.
    max_captures: signatures captured per callable; after that, calls with new signatures
      run through `jax.jit` (one warning).
    on_new_signature: "capture" (up to `max_captures`) or "error" (raise on any signature
      that was not captured from `sample_args`). Either names the argument paths where the
      signature differs from the closest one captured (shape, dtype, weak type, sharding):
      "capture" in a WARNING on the `jaxgraph` logger (silence it with
      `logging.getLogger("jaxgraph").setLevel(logging.ERROR)`), "error" in the `TypeError`.
    remat_policy: which intermediates the forward saves for the backward, as a
      `jax.checkpoint` policy; the others are recomputed inside the backward executable.
      None (the default) saves every residual `jax.vjp` keeps: bitwise `jax.vjp(fn)`.
      `jaxgraph.residuals.recompute_elementwise` saves the outputs of matmuls, attention,
      reductions and comparisons (masks) and recomputes elementwise ops and layout changes,
      as XLA does by fusion inside one whole-step executable: a quarter of the residual
      memory and less device time for a GPT block (docs/performance.md). With a policy the
      results are bitwise those of `jax.vjp(jax.checkpoint(fn, policy=...))`, which can
      differ from `jax.vjp(fn)` by rounding (jax.checkpoint rounds saved values to their
      dtype: `reduce_precision`).
    inference_only: capture for `g(*args)` only. Each signature is traced as the function
      is (not through `jax.vjp`) and compiles exactly one executable, at capture: the
      outputs-only forward (with `rng`, the stream forward, which still advances the key
      stream; one taking `key=` compiles on its first such call). No residuals, no backward:
      `g.vjp` and `sequential_vjp` raise. Warmup runs the forwards only, so `pre_forward`
      and `forward` hooks fire there and at capture, backward hooks never. Signatures
      captured later (`max_captures`) are forward-only too. Not combinable with
      `delay_wgrad`, `offload_residuals`, `order` or `remat_policy`, which concern the
      backward.
    donate_argnums: with `inference_only=True`, the positional arguments donated to the
      forward, as `jax.jit(fn, donate_argnums=...)`: XLA may write an output into a donated
      buffer (a KV cache updated in place instead of copied), and after a call those input
      arrays are deleted; pass the returned ones next time. A FlatTree argument donates its
      buffers; an explicit `key=` is never donated. A buffer XLA finds no same-shaped output
      for is not donated (it stays alive), silently (capture filters jax's "Some donated
      buffers were not usable" warning; the `jax.jit` fallback lets it through). Warmup
      runs on copies of these arguments, so arrays given as `sample_args` stay alive, and a
      replay-time `forward` hook finds the donated arguments in `event.args` deleted. The
      `jax.jit` fallback after `max_captures` donates the same arguments; inside a user's
      `jax.jit` the function just runs (donate there).
    per_layer_executables: identical callables still compile once, but each replays its own
      loaded copy of the executables (loaded from the one compile on its first replay, in
      warmup). XLA's GPU command buffers keep the buffer addresses they were recorded
      with per loaded executable and re-record when a call passes other buffers: one
      executable shared by 12 layers re-records on every call, a copy per layer sees its
      own parameter buffers step after step (at small sizes on an H100: 43% less host time
      and 28% less step time, docs/performance.md). None (the default): on where the
      default backend is a GPU. An executable spanning several devices (FSDP) is copied
      on the same devices, in its device order.
    compiler_options: XLA options for these callables' executables only (every forward,
      backward and wgrad, fused segments' too), as `jax.jit(..., compiler_options=...)`:
      XLA's DebugOptions by name (the flags `XLA_FLAGS` takes, without the leading `--`)
      to a bool, int, float or str (a list as a comma-separated str, e.g.
      `{"xla_gpu_enable_command_buffer": "FUSION,CUBLAS"}`); they apply over the
      process's `XLA_FLAGS`, which stay as they are for everything else. Executables
      compiled with other options (another `make_graphed` call) are never shared. Each
      option is checked by XLA when `make_graphed` is called (one trivial compile).

  Returns:
    One `GraphedCallable` for a single callable, else a tuple of them.

  Raises:
    TypeError: for an argument of the wrong type: `fns` not a callable or a sequence of
      them, `sample_args` entries that are not tuples or hold leaves that are not arrays
      (or `jax.ShapeDtypeStruct`s), a flag that is not a bool, a count or argnum that is
      not an int (bools are not counts), hooks that are not `jaxgraph.Hooks`, warmup hooks
      or `remat_policy` that are not callable, `grad_mask` leaves that are not bools,
      `sample_args` holding tracers (make_graphed under `jax.jit`: call it outside), a
      Flax module as a function (split it with `jaxgraph.flax.nnx_layer` /
      `linen_layer`), a function that needs `key=` without `rng=True` or one without a
      `key` parameter with it, `rng` neither a bool nor a typed key, `order`
      entries or `num_layers_per_chunk` that are not ints, `offload_names` not a sequence
      of strings, `compiler_options` not a dict of str to bool, int, float or str.
      Errors raised while tracing or compiling a function propagate, with a note naming
      the callable and its `sample_args` entry.
    ValueError: for an argument of the right type with a bad value: no callables, a number
      of `sample_args` (or hooks, or offload flags) that does not match the callables, a
      count below its minimum, an unknown `on_new_signature`, an invalid `order` or
      `num_layers_per_chunk`, an argnum out of range (or repeated in `donate_argnums`),
      `inference_only=True` with `delay_wgrad`, `offload_residuals`, `order`,
      `remat_policy` or `grad_mask`, a `compiler_options` name XLA does not know or a
      value it cannot parse for that option, a `grad_mask` whose structure is not a prefix of
      the positional arguments, `donate_argnums` without `inference_only=True`, an unknown
      `offload_mode`, `offload_min_bytes` or `offload_names` without an offloaded layer
      (or empty names), and `offload_residuals` on a backend without pinned host memory.
      Each error names the argument; all are raised before anything is traced or a hook
      fires.
  """
  layers = _check_layers(fns, hooks, capture_time_hooks, sample_args, order,
                         num_layers_per_chunk, delay_wgrad=delay_wgrad,
                         offload_residuals=offload_residuals)
  iterations = _check_warmup(num_warmup_iters, pre_warmup_hook, post_warmup_hook)
  seed = _seed(rng)
  config = _check_config(layers, order, rng=seed is not None, delay_wgrad=delay_wgrad,
                         wgrad_argnums=wgrad_argnums, max_captures=max_captures,
                         on_new_signature=on_new_signature, remat_policy=remat_policy,
                         inference_only=inference_only, donate_argnums=donate_argnums,
                         per_layer_executables=per_layer_executables, grad_mask=grad_mask,
                         compiler_options=compiler_options,
                         offload=_check_offload(any(layers.offload), offload_mode,
                                                offload_min_bytes, offload_names))
  built = _build_callables(layers, config, seed)
  with hooks_lib.capturing():
    _capture_all(built, layers.samples, layers.plan, layers.sizes,
                 inference_only=config.inference_only)
    _warmup_between_hooks(built, layers, config, iterations, pre_warmup_hook,
                          post_warmup_hook)
  return built[0] if layers.single else tuple(built)
