"""`make_graphed`: argument checks, building GraphedCallables, capture and warmup."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jaxgraph import graphed as graphed_lib
from jaxgraph import hooks as hooks_lib
from jaxgraph import offload as offload_lib
from jaxgraph import rng as rng_lib
from jaxgraph import schedule as schedule_lib
from jaxgraph import signature as sig_lib

_ON_NEW_SIGNATURE = ("capture", "error")


def _as_callables(fns: Callable[..., Any] | Sequence[Callable[..., Any]]
                  ) -> tuple[list[Callable[..., Any]], bool]:
  if callable(fns):
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
  return fns, False


def _per_callable_args(sample_args: Any, count: int, single: bool) -> list[tuple[Any, ...]]:
  if sample_args is None:
    raise TypeError("make_graphed needs sample_args: per callable, a tuple of its positional "
                    "arguments (arrays or jax.ShapeDtypeStruct).")
  if single:
    sample_args = [sample_args]
  if not isinstance(sample_args, Sequence) or len(sample_args) != count:
    got = len(sample_args) if isinstance(sample_args, Sequence) else type(sample_args).__name__
    raise ValueError(f"make_graphed got {count} callables but sample_args has {got} entries; "
                     "pass one tuple of positional arguments per callable.")
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
  entries = len(sample_args) if isinstance(sample_args, Sequence) else None
  if entries not in (layers, layers * microbatches):
    got = entries if entries is not None else type(sample_args).__name__
    raise ValueError(
        f"with order=..., sample_args takes one tuple per layer ({layers}) or, as Transformer "
        f"Engine, one per (chunk, microbatch, layer) ({layers} * {microbatches} = "
        f"{layers * microbatches}), but got {got}.")
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
  if isinstance(value, bool):
    return [value] * count
  flags = list(value)
  if len(flags) != count or not all(isinstance(f, bool) for f in flags):
    raise ValueError(f"{argument} takes a bool or one bool per callable ({count}), got {value!r}.")
  return flags


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
  """Capture phase, in the order of `plan` (without `order`: every forward in order, every
  backward in reverse; `inference_only`: the forwards only), hooks around each;
  `samples[i][m]` are the args of layer i at microbatch m. Wgrad entries fire no hooks
  (Transformer Engine's rule)."""
  outputs = {}
  for kind, i, m in _steps(plan, sizes, inference_only=inference_only):
    layer, args = layers[i], samples[i][m]
    if kind == "forward":
      leaves, treedef = jax.tree.flatten(args)
      signature = sig_lib.signature_of(leaves, treedef)
      pre, post = layer._forward_hooks("capture")
      event = hooks_lib.HookEvent(layer.index, "capture", 0, m, _abstract_tree(args))
      hooks_lib.fire(pre, "pre_forward", event, layer.name)
      try:
        entry = layer._entry(signature)
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
      pre, post = layer._backward_hooks("capture")
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


def _check_inference_only(inference_only: bool, *, delay_wgrad: bool,
                          order: Sequence[float] | None, offload: bool,
                          remat_policy: Callable[..., bool] | None) -> None:
  if not isinstance(inference_only, bool):
    raise TypeError(f"inference_only must be a bool, got {inference_only!r}.")
  if not inference_only:
    return
  conflicts = [name for name, given in (("delay_wgrad", delay_wgrad),
                                        ("offload_residuals", offload),
                                        ("order", order is not None),
                                        ("remat_policy", remat_policy is not None)) if given]
  if conflicts:
    raise ValueError(
        f"make_graphed got inference_only=True together with {' and '.join(conflicts)}, "
        "which only concern a backward (an inference-only callable has none). Drop "
        f"{' and '.join(conflicts)}, or drop inference_only to train.")


def _check_donate_argnums(donate_argnums: Sequence[int], samples: Sequence[tuple[Any, ...]],
                          *, inference_only: bool) -> tuple[int, ...]:
  if not isinstance(donate_argnums, Sequence) or isinstance(donate_argnums, (str, bytes)):
    raise TypeError(f"donate_argnums must be a sequence of ints, e.g. (2,), got "
                    f"{donate_argnums!r}.")
  argnums = tuple(donate_argnums)
  if not argnums:
    return argnums
  if not inference_only:
    raise ValueError(
        f"make_graphed got donate_argnums={argnums} without inference_only=True: a training "
        "forward's inputs are needed again by its backward, so they cannot be donated. Pass "
        "inference_only=True (a decode step), or drop donate_argnums.")
  bad = [a for a in argnums if isinstance(a, bool) or not isinstance(a, int)]
  if bad:
    raise TypeError(f"donate_argnums must hold ints (positional argument indices), got "
                    f"{bad[0]!r} in {argnums}.")
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
    offload_residuals: bool | Sequence[bool] = False,
    max_captures: int = 8,
    on_new_signature: graphed_lib.OnNewSignature = "capture",
    remat_policy: Callable[..., bool] | None = None,
    inference_only: bool = False,
    donate_argnums: Sequence[int] = (),
    per_layer_executables: bool | None = None,
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
    post_warmup_hook: called once after the whole warmup, no arguments.
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
    offload_residuals: keep forward residuals in pinned host memory until the backward; a bool
      or one bool per callable.
    max_captures: signatures captured per callable; after that, calls with new signatures
      run through `jax.jit` (one warning).
    on_new_signature: "capture" (up to `max_captures`) or "error" (raise on any signature
      that was not captured from `sample_args`).
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
      default backend is a GPU. Executables spanning several devices (sharded) are shared
      as before.

  Returns:
    One `GraphedCallable` for a single callable, else a tuple of them.

  Raises:
    ValueError: for `inference_only=True` with `delay_wgrad`, `offload_residuals`,
      `order` or `remat_policy`, for `donate_argnums` without `inference_only=True`, out
      of range or repeated, and for other invalid arguments (each error names the argument).
  """
  fn_list, single = _as_callables(fns)
  count = len(fn_list)
  if not isinstance(delay_wgrad, bool):
    raise TypeError(f"delay_wgrad must be a bool, got {delay_wgrad!r}.")
  if order is None:
    if num_layers_per_chunk is not None:
      raise ValueError("num_layers_per_chunk only applies with order=[...]; drop it, or pass "
                       "the pipeline order.")
    samples = _per_callable_args(sample_args, count, single)
    plan, sizes, per_microbatch = _NO_ORDER, (count,), [[args] for args in samples]
  else:
    plan = schedule_lib.parse_order(order, delay_wgrad=delay_wgrad)
    sizes = schedule_lib.layers_per_chunk(num_layers_per_chunk, plan.num_chunks, count)
    samples, per_microbatch = _pipeline_args(sample_args, single, sizes, plan.num_microbatches)
  if (isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int)
      or num_warmup_iters < 0):
    raise ValueError(f"num_warmup_iters must be an int >= 0, got {num_warmup_iters!r}.")
  if isinstance(max_captures, bool) or not isinstance(max_captures, int) or max_captures < 1:
    raise ValueError(f"max_captures must be an int >= 1, got {max_captures!r}.")
  if on_new_signature not in _ON_NEW_SIGNATURE:
    raise ValueError(f"on_new_signature must be one of {_ON_NEW_SIGNATURE}, got "
                     f"{on_new_signature!r}.")
  if remat_policy is not None and not callable(remat_policy):
    raise TypeError(f"remat_policy must be a jax.checkpoint policy (a callable, e.g. "
                    f"jaxgraph.residuals.recompute_elementwise) or None, got {remat_policy!r}.")
  for name, hook in (("pre_warmup_hook", pre_warmup_hook), ("post_warmup_hook", post_warmup_hook)):
    if hook is not None and not callable(hook):
      raise TypeError(f"{name} must be a callable taking no arguments, got {hook!r}.")
  if isinstance(rng, bool):
    seed = jax.random.key(0) if rng else None
  else:
    rng_lib.check_key(rng, "make_graphed(rng=...)")
    seed = rng
  if not isinstance(wgrad_argnums, Sequence):
    raise TypeError(f"wgrad_argnums must be a sequence of ints, e.g. (0,), got "
                    f"{wgrad_argnums!r}.")
  wgrad_argnums = tuple(wgrad_argnums)
  if not all(isinstance(i, int) and i >= 0 for i in wgrad_argnums):
    raise ValueError(f"wgrad_argnums must be non-negative ints, got {wgrad_argnums!r}.")
  for i, args in enumerate(samples):
    if delay_wgrad and any(argnum >= len(args) for argnum in wgrad_argnums):
      raise ValueError(f"wgrad_argnums={wgrad_argnums} but sample_args[{i}] has only "
                       f"{len(args)} positional arguments.")
    leaves, treedef = jax.tree.flatten(args)
    try:
      sig_lib.signature_of(leaves, treedef)
    except TypeError as e:
      raise TypeError(f"sample_args[{i}]: {e}") from None
  offload = _per_callable_flags(offload_residuals, count, "offload_residuals")
  _check_inference_only(inference_only, delay_wgrad=delay_wgrad, order=order,
                        offload=any(offload), remat_policy=remat_policy)
  donate_argnums = _check_donate_argnums(donate_argnums, samples, inference_only=inference_only)
  if any(offload):
    offload_lib.check_backend_supports_offload()
  replay_hooks = hooks_lib.per_callable(hooks, count, "hooks")
  capture_hooks = hooks_lib.per_callable(capture_time_hooks, count, "capture_time_hooks")

  config = graphed_lib.Config(rng=seed is not None, delay_wgrad=delay_wgrad,
                              wgrad_argnums=wgrad_argnums, max_captures=max_captures,
                              on_new_signature=on_new_signature,
                              inference_only=inference_only, remat_policy=remat_policy,
                              donate_argnums=donate_argnums,
                              per_layer_executables=(jax.default_backend() == "gpu"
                                                     if per_layer_executables is None
                                                     else bool(per_layer_executables)))
  layers = [graphed_lib.GraphedCallable(fn, i, config, hooks=replay_hooks[i],
                                        capture_time_hooks=capture_hooks[i], offload=offload[i])
            for i, fn in enumerate(fn_list)]
  if seed is not None:
    for layer in layers:
      layer.seed(seed)
  with hooks_lib.capturing():
    _capture_all(layers, per_microbatch, plan, sizes, inference_only=inference_only)
    if pre_warmup_hook is not None:
      pre_warmup_hook()
    _warmup(layers, per_microbatch, plan, sizes, num_warmup_iters, rng=config.rng,
            delay_wgrad=delay_wgrad, inference_only=inference_only,
            donate_argnums=donate_argnums)
    if post_warmup_hook is not None:
      post_warmup_hook()
  return layers[0] if single else tuple(layers)
