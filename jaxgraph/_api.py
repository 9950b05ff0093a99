"""`make_graphed`: checks its arguments, builds GraphedCallables, captures and warms them up.

`make_graphed` runs four steps in order: check every argument (`_checks`, before anything is
traced or a hook fires), build one GraphedCallable per callable, capture (trace and compile
each distinct signature once), warm up. Capture and warmup run under `_hooks.capturing()`, so
`is_capturing()` is True inside them and False again however they end.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from jaxgraph import _checks as checks
from jaxgraph import _graphed as graphed_lib
from jaxgraph import _hooks as hooks_lib
from jaxgraph import _signature as sig_lib
from jaxgraph import offload as offload_lib
from jaxgraph import rng as rng_lib
from jaxgraph import schedule as schedule_lib


def _materialize(leaf: Any) -> Any:
  """Concrete warmup data for a sample leaf: arrays as given, zeros for ShapeDtypeStructs."""
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return jnp.zeros(leaf.shape, leaf.dtype, device=leaf.sharding)  # made where it lives
  return leaf


def _fresh(args: tuple[Any, ...], donate_argnums: tuple[int, ...]) -> tuple[Any, ...]:
  """`args` with copies of the donated arguments: a warmup forward consumes those, and
  must not consume the caller's sample arrays (or the next iteration's data)."""
  return tuple(jax.tree.map(jnp.copy, arg) if argnum in donate_argnums else arg
               for argnum, arg in enumerate(args))


def _ones_like(tree: Any) -> Any:
  return jax.tree.map(lambda leaf: jnp.ones_like(leaf), tree)


def _steps(parsed: schedule_lib.ParsedOrder, sizes: Sequence[int], *, inference_only: bool
           ) -> list[tuple[str, int, int]]:
  """`(kind, layer, microbatch)` of `parsed`; its forwards only for inference-only layers."""
  return [step for step in schedule_lib.layer_steps(parsed, sizes)
          if not inference_only or step[0] == "forward"]


def _capture_all(layers: Sequence[graphed_lib.GraphedCallable],
                 samples: Sequence[Sequence[tuple[Any, ...]]], parsed: schedule_lib.ParsedOrder,
                 sizes: Sequence[int], *, inference_only: bool) -> None:
  """Step 3, capture: in the order of `parsed` (without `order`: every forward in order, every
  backward in reverse; `inference_only`: the forwards only), hooks around each;
  `samples[i][m]` are the args of layer i at microbatch m. Wgrad entries fire no hooks
  (Transformer Engine's rule)."""
  outputs = {}
  for kind, i, m in _steps(parsed, sizes, inference_only=inference_only):
    layer, args = layers[i], samples[i][m]
    if kind == "forward":
      leaves, treedef = jax.tree.flatten(args)
      signature = sig_lib.signature_of(leaves, treedef)
      hooks = layer.phase_hooks["capture"]
      pre, post = hooks.pre_forward, hooks.forward
      event = hooks_lib.HookEvent(layer.index, "capture", 0, m, sig_lib.abstract_tree(args))
      hooks_lib.fire(pre, "pre_forward", event, layer.name)
      try:
        entry = layer.executables.get(signature, sampled=True)
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
      hooks = layer.phase_hooks["capture"]
      pre, post = hooks.pre_backward, hooks.backward
      event = hooks_lib.HookEvent(layer.index, "capture", 0, m, abstract_args,
                                  outputs=out, cotangents=out)
      hooks_lib.fire(pre, "pre_backward", event, layer.name)
      hooks_lib.fire(post, "backward", hooks_lib.HookEvent(
          layer.index, "capture", 0, m, abstract_args, outputs=out, cotangents=out,
          grads=abstract_args), layer.name)


def _warmup(layers: Sequence[graphed_lib.GraphedCallable],
            samples: Sequence[Sequence[tuple[Any, ...]]], parsed: schedule_lib.ParsedOrder,
            sizes: Sequence[int], iterations: int, *, rng: bool, delay_wgrad: bool,
            inference_only: bool, donate_argnums: tuple[int, ...]) -> None:
  """Warmup phase: replays the order of `parsed` exactly (without `order`: all forwards, then
  all backwards in reverse; `inference_only`: the outputs-only forwards alone); a wgrad
  without its own order entry runs right after its backward. Each step's result is waited for
  and dropped (kept, an order of M microbatches would hold iterations x M copies of every
  layer's outputs and grads at once); each forward gets fresh copies of the `donate_argnums`
  arguments."""
  materialized: dict[int, Any] = {}  # one-per-layer sample_args repeat across microbatches
  data = [[materialized.setdefault(id(args), jax.tree.map(_materialize, args)) for args in row]
          for row in samples]
  base = rng_lib.warmup_base() if rng else None
  for iteration in range(iterations):
    stream = (base, jnp.uint32(iteration)) if rng else None
    pending = {}
    for kind, i, m in _steps(parsed, sizes, inference_only=inference_only):
      layer, args = layers[i], data[i][m]
      if kind == "forward":
        if donate_argnums:
          args = _fresh(args, donate_argnums)
        leaves, treedef = jax.tree.flatten(args)
        pending[i, m] = layer.forward(args, leaves, treedef, None, phase="warmup",
                                      iteration=iteration, microbatch=m,
                                      with_pullback=not inference_only, stream=stream)
        result = pending[i, m][0]
      elif kind == "backward":
        out, pullback = pending[i, m] if parsed.has_wgrad else pending.pop((i, m))
        result = pullback(_ones_like(out))
        if delay_wgrad and not parsed.has_wgrad:
          result = (result, pullback.wgrad())
      else:
        result = pending.pop((i, m))[1].wgrad()
      jax.block_until_ready(result)


def _build_callables(layers: checks.Layers, config: graphed_lib.Config,
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


def _warmup_between_hooks(built: Sequence[graphed_lib.GraphedCallable], layers: checks.Layers,
                          config: graphed_lib.Config, iterations: int,
                          pre_warmup_hook: Callable[[], None] | None,
                          post_warmup_hook: Callable[[], None] | None) -> None:
  """Step 4: `iterations` warmup iterations between the two warmup hooks. Once
  `pre_warmup_hook` returned, `post_warmup_hook` runs also when the warmup raises (a user
  who turns something off in one and back on in the other is not left switched off)."""
  if pre_warmup_hook is not None:
    pre_warmup_hook()
  try:
    _warmup(built, layers.samples, layers.parsed, layers.sizes, iterations, rng=config.rng,
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
  layers = checks.check_layers(fns, hooks, capture_time_hooks, sample_args, order,
                               num_layers_per_chunk, delay_wgrad=delay_wgrad,
                               offload_residuals=offload_residuals)
  iterations = checks.check_warmup(num_warmup_iters, pre_warmup_hook, post_warmup_hook)
  seed = checks.seed_of(rng)
  offload = checks.check_offload(any(layers.offload), offload_mode, offload_min_bytes,
                                 offload_names)
  config = checks.check_config(layers, order, rng=seed is not None, delay_wgrad=delay_wgrad,
                               wgrad_argnums=wgrad_argnums, max_captures=max_captures,
                               on_new_signature=on_new_signature, remat_policy=remat_policy,
                               inference_only=inference_only, donate_argnums=donate_argnums,
                               per_layer_executables=per_layer_executables,
                               grad_mask=grad_mask, compiler_options=compiler_options,
                               offload=offload)
  built = _build_callables(layers, config, seed)
  with hooks_lib.capturing():
    _capture_all(built, layers.samples, layers.parsed, layers.sizes,
                 inference_only=config.inference_only)
    _warmup_between_hooks(built, layers, config, iterations, pre_warmup_hook,
                          post_warmup_hook)
  return built[0] if layers.single else tuple(built)
