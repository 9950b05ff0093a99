"""--init-from RUN_DIR and --lora RANK: a new run that starts from the params of a trained run
(the newest intact checkpoint in RUN_DIR/checkpoints, digests verified), trains all of them
(fine-tuning), or with --lora low-rank adapters over them, the base frozen (LoRA).

LoRA here is Flax's own: every projection of a block's attention (query, key, value, out)
and MLP (gate, up, down) becomes an `nnx.LoRALinear` (`add_adapters`), which keeps the
`nnx.Linear`'s kernel at its path and adds `lora.lora_a` (random) and `lora.lora_b` (zero)
beside it, so the adapted model starts as the base model. The adapters are held inside each
block's params, as `nnx_layer` splits an NNX model with `nnx.LoRAParam`s (and as an NNX user
writes LoRA), not as a pytree of their own: the block function stays `nnx_layer`'s, the
base's leaves keep their paths, and what is frozen is said once, by a mask:

* `make_graphed(..., grad_mask=grad_mask)` leaves the base out of every backward (no
  weight-gradient matmul for a frozen kernel; the embedding and head are frozen whole);
* `jg.partition(params, masks)` gives the optimizer the adapters only (`Trainer(masks=...)`),
  so AdamW keeps no moments for the base and never decays it, and drops the base's float0
  gradients; `jg.combine` puts the updated adapters back beside the untouched base.

With --flat (the default) the adapters are a buffer of their own in each block's FlatTree
(group "lora", beside "decay" and "no_decay"): the mask is one bool per buffer
(`jg.flat.mask`), the base buffers are the base run's bytes, and a block's backward returns
one gradient buffer. Checkpoints hold the whole params (base and adapters), so a LoRA run
resumes from its own --out without the base run; its metadata records where it started
(`fine_tuning`), and metrics.json the base params' digest before and after (equal).

A fine-tuned run is itself a run to start from: a LoRA run's adapters are merged into its
kernels (`merge_adapters`: W + A @ B), and the merged model is fine-tuned whole or given new
adapters (merged, not kept frozen beside them: one kernel per projection, so the step, the
checkpoints and generation stay those of any run).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

import jaxgraph as jg
from examples.checkpoints import Checkpoints, NoCheckpoint
from examples.records import arrays_sha256

from .checkpoints import check_vocabulary, run_config, shown_config
from .layers import Params, split
from .model import Llama
from .placement import Placement
from .presets import Preset
from .trainer import flat_group, optimizer

# The block projections that get adapters, by the module that holds them.
ADAPTED = {"attention": ("query", "key", "value", "out"), "mlp": ("gate", "up", "down")}
# The flags of the run an --init-from loads that this run must share: they make the params'
# shapes and layout (the model: preset, tied head, text and vocabulary; flat buffers; how many
# key streams its checkpoints hold).
MODEL_FLAGS = ("preset", "untied", "text", "vocab", "flat", "plain_ends")
# What a fine-tuning run is refused with: its flag, and why.
CONFLICTS = {
    "--fsdp": ("init_from", "loads the run's params on one device"),
    "--whole-step": ("lora", "trains through the graphed layers (grad_mask)"),
    "--check": ("lora", "trains through the graphed layers (grad_mask), which --check compares "
                        "with a whole-step jax.jit of the full model"),
    "--offload": ("lora", "is measured and planned for the full backward"),
}


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace,
                preset: Preset) -> None:
  """--lora and --init-from, before anything is built (argparse errors): the rank, the flags
  that do not go with them, and the run named: a trained run (a checkpoint whose metadata
  passes its digest) of this run's model and vocabulary, not this run's own --out. --check
  is off for a LoRA run unless asked for (and then refused)."""
  if args.lora is not None and args.lora < 1:
    parser.error(f"--lora takes a rank >= 1, got {args.lora}")
  narrowest, shape = narrowest_projection(preset)
  if args.lora is not None and args.lora > narrowest:
    parser.error(f"--lora {args.lora} is above the rank the model's projections can have: the "
                 f"narrowest adapted one ({shape}) has rank at most {narrowest} (the "
                 f"preset's width is {preset.width}), and a higher-rank adapter trains more "
                 "params than the kernel it adapts for no larger update: pass --lora "
                 f"{narrowest} or less (LoRA ranks sit far below the width)")
  if args.lora is not None and args.init_from is None:
    parser.error("--lora RANK fine-tunes a trained run: pass --init-from RUN_DIR, the --out of "
                 "that run (train one first, e.g. with --preset tiny)")
  given = {"--fsdp": args.fsdp is not None, "--whole-step": args.whole_step,
           "--check": bool(args.check), "--offload": args.offload.kind != "none"}
  for flag, (needs, why) in CONFLICTS.items():
    if given[flag] and getattr(args, needs) is not None:
      name = "--lora" if needs == "lora" else "--init-from"
      parser.error(f"{name} {why}; {flag} is not supported with it: drop {flag}")
  if args.lora is not None and args.check is None:
    args.check = False
  if args.init_from is None:
    return
  legacy = args.legacy_metadata
  own = args.out / "checkpoints"
  if args.resume and own.is_dir() and Checkpoints(
      own, legacy_metadata=legacy).latest_meta() is not None:
    return  # its own checkpoints hold the params: the run it started from is not read again
  run = args.init_from
  if run.absolute() == args.out.absolute():
    parser.error(f"--init-from {run} is this run's --out: a fine-tuning run starts from a "
                 "trained run and writes to an --out of its own")
  directory = run / "checkpoints"
  checkpoints = (Checkpoints(directory, legacy_metadata=legacy) if directory.is_dir()
                 else None)
  latest = None if checkpoints is None else checkpoints.latest_meta()
  if latest is None:
    problems = [] if checkpoints is None else checkpoints.meta_problems()
    parser.error(f"--init-from: no intact checkpoint in {directory}"
                 + (": " + "; ".join(f"step {step} {problem}" for step, problem in problems)
                    if problems else "")
                 + ". Pass the --out of a trained run (it keeps its newest checkpoints there)")
  saved, ours = shown_config(latest[1].get("config", {})), shown_config(run_config(args, preset))

  def show(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)

  differ = [f"--{name.replace('_', '-')} {show(ours.get(name))} (the run in {run}: "
            f"{show(saved.get(name))})" for name in MODEL_FLAGS
            if ours.get(name) != saved.get(name)]
  if differ:
    parser.error(f"--init-from loads params of another model or layout than this run's: "
                 f"{', '.join(differ)}. Pass the flags that run was trained with")
  check_vocabulary(parser, run, preset, args.cache, flag="--init-from", legacy_metadata=legacy)


def narrowest_projection(preset: Preset) -> tuple[int, str]:
  """The highest rank an adapter of the preset's model can use, min(in, out) of its
  narrowest adapted projection, and that projection's shape as a message names it."""
  kv = preset.kv_heads * (preset.width // preset.heads)
  shapes = {"key/value": (preset.width, kv), "query/out": (preset.width, preset.width),
            "gate/up": (preset.width, preset.hidden)}
  name, (fan_in, fan_out) = min(shapes.items(), key=lambda item: min(item[1]))
  return min(fan_in, fan_out), f"{name}, {fan_in} x {fan_out}"


@dataclasses.dataclass(frozen=True)
class FineTuning:
  """What a fine-tuning run trains and records (`start`); a plain run's has no masks.

  Attributes:
    masks: per part, which params train (a `grad_mask`-style mask; None: all of them).
    meta: what checkpoints and metrics.json record of the start: the run loaded, its step,
      the params' digest then, the LoRA rank and the count of trained params.
  """

  masks: list[Any] | None = None
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def grad_mask(self) -> Callable[..., tuple[Any, ...]] | None:
    """`make_graphed`'s `grad_mask` for the training layers (None: every float leaf)."""
    return None if self.masks is None else grad_mask

  def trainable(self, params: Params) -> Params:
    """The part of `params` the optimizer takes."""
    return params if self.masks is None else jg.partition(params, self.masks)[0]

  def residual_policy(self, policy: Callable[..., bool] | None
                      ) -> Callable[..., bool] | None:
    """The training layers' `remat_policy`: `policy`, and with LoRA adapters each adapter's
    output recomputed by the backward (`recompute_adapter_outputs`)."""
    if self.masks is None or policy is None:
      return policy
    return recompute_adapter_outputs(policy, self.meta["lora_rank"])

  def report(self, params: Params, placement: Placement) -> dict[str, Any]:
    """metrics.json's `fine_tuning`: the start, and for LoRA the frozen params' digest now,
    which must be the digest they had at the start."""
    if not self.meta:
      return {}
    if self.masks is None:
      return {"fine_tuning": self.meta}
    after = frozen_digest(params, self.masks, placement)
    return {"fine_tuning": {**self.meta, "base_params_sha256_after": after}}


def recompute_adapter_outputs(policy: Callable[..., bool], rank: int) -> Callable[..., bool]:
  """`policy`, except that an adapter's output `(x @ A) @ B` is recomputed, not kept.

  Under `recompute_elementwise` every matmul output is kept, and an adapted projection's
  output (`x @ W` plus the adapter's, an addition) is recomputed from both: kept, the
  adapter's output would double what each projection keeps (on the `gpu` preset the LoRA
  step's peak rose above full fine-tuning's). Recomputing it costs one matmul of rank `rank`
  from `x @ A`, which the backward keeps anyway (B's gradient reads it). Matched by shape:
  a matmul without batch dimensions whose right operand, a `rank` x n matrix, is contracted
  over its `rank` rows.
  """

  def keep(prim: Any, *avals: Any, **params: Any) -> bool:
    if prim.name == "dot_general":
      (_, rhs_contracting), (lhs_batch, _) = params["dimension_numbers"]
      rhs = avals[1]
      if (not lhs_batch and rhs.ndim == 2 and rhs.shape[0] == rank
          and tuple(rhs_contracting) == (0,)):
        return False
    return policy(prim, *avals, **params)

  return keep


def is_adapter(path: tuple[Any, ...]) -> bool:
  """A leaf of a `nnx.LoRALinear`'s adapters (`...['lora']['lora_a']`)."""
  return any(getattr(key, "key", None) == "lora" for key in path)


def adapter_group(path: tuple[Any, ...], leaf: jax.Array) -> str:
  """--flat's buffers of an adapted part: the adapters in a buffer of their own ("lora"),
  the rest as `trainer.flat_group` groups them."""
  return "lora" if is_adapter(path) else flat_group(path, leaf)


def part_mask(part: Any) -> Any:
  """True for the adapters of one part's params (a FlatTree: by buffer; a state: by leaf)."""
  if jg.flat.is_flat(part):
    return jg.flat.mask(part, lambda group: group == "lora")
  return jax.tree_util.tree_map_with_path(lambda path, _: is_adapter(path), part)


def grad_mask(*args: Any) -> tuple[Any, ...]:
  """The training layers' `grad_mask`: of every part's params (a block's, the embedding's,
  and the embedding's again as the tied head's input) the adapters only; every other input
  (the activations, token ids, positions) as usual."""
  return tuple(part_mask(arg) if jg.flat.is_flat(arg) or isinstance(arg, nnx.State) else True
               for arg in args)


def frozen_digest(params: Params, masks: list[Any], placement: Placement) -> str:
  """sha256 of the params that do not train (the base), in order."""
  return arrays_sha256(placement.host(jg.partition(params, masks)[1]))


def add_adapters(model: Llama, rank: int, seed: int) -> None:
  """Replaces every projection of `ADAPTED` in the model's blocks by an `nnx.LoRALinear` of
  rank `rank` holding the same kernel: A drawn (Flax's default, He-uniform), B zero."""
  rngs = nnx.Rngs(params=seed)
  for block in model.blocks:
    for holder, names in ADAPTED.items():
      module = getattr(block, holder)
      for name in names:
        linear = getattr(module, name)
        adapted = nnx.LoRALinear(linear.in_features, linear.out_features, lora_rank=rank,
                                 use_bias=False, dtype=linear.dtype,
                                 param_dtype=linear.param_dtype, lora_dtype=linear.dtype,
                                 lora_param_dtype=linear.param_dtype, rngs=rngs)
        adapted.kernel = linear.kernel
        setattr(module, name, adapted)


def saved_rank(run: pathlib.Path, legacy_metadata: bool) -> int | None:
  """The --lora rank of the run in `run` (None: it trained every param), from the metadata
  of its newest intact step."""
  latest = Checkpoints(run / "checkpoints", legacy_metadata=legacy_metadata).latest_meta()
  return None if latest is None else latest[1].get("config", {}).get("lora")


def load_run(args: argparse.Namespace, preset: Preset, model: Llama, params: Params,
             placement: Placement, streams: int) -> tuple[int, Params, int | None]:
  """The step and params of the newest intact checkpoint of the run in `args.init_from`,
  written into `model`; and that run's --lora rank. A LoRA run's adapters are merged into
  its kernels (W + A @ B: the model it computed, as plain projections), so that this run
  fine-tunes or adapts that model. `params`: the structure and placement of a plain run's;
  the optimizer state is read to the host for the digests, and dropped. A damaged newer
  step is named and left in place (another run's); no intact step ends the run in one line."""
  rank = saved_rank(args.init_from, args.legacy_metadata)
  saved = model
  if rank is not None:  # the LoRA run's model: adapters over this one's projections
    saved = nnx.clone(model)
    add_adapters(saved, rank, seed=0)  # structure only: the checkpoint's values replace them
    params = placement.shard([jg.flat.ravel(p, group=adapter_group) if args.flat else p
                              for p in split(saved)[1]])
  tx = optimizer(preset, preset.steps)  # the state's structure only
  trained = params if rank is None else jg.partition(params, [part_mask(p) for p in params])[0]
  opt_state = jax.tree.map(lambda s: np.empty(s.shape, s.dtype),
                           jax.eval_shape(tx.init, trained))
  keys = [(jax.random.key(0), 0)] * streams
  checkpoints = Checkpoints(args.init_from / "checkpoints", host=placement.host,
                            legacy_metadata=args.legacy_metadata)
  try:
    restored = checkpoints.restore(params, opt_state, keys, move_rejected=False)
  except NoCheckpoint as e:
    sys.exit(f"--init-from {args.init_from}: {e}. Its steps are left in place: pass the --out "
             "of a trained run whose checkpoints restore")
  parts = [saved.embed, *saved.blocks, saved.head]
  for part, state in zip(parts, jg.flat.unravel(restored.params)):
    nnx.update(part, state)
  if rank is not None:
    merge_adapters(saved, model)
  return restored.step, restored.params, rank


def merge_adapters(adapted: Llama, model: Llama) -> None:
  """Writes `adapted`'s params into `model`, the same model without adapters: every
  projection's kernel W + A @ B (float32), every other param as it is."""
  for part, into in zip([adapted.embed, *adapted.blocks, adapted.head],
                        [model.embed, *model.blocks, model.head]):
    _, _, rest = nnx.split(part, nnx.LoRAParam, ...)
    nnx.update(into, rest)
  for block, into in zip(adapted.blocks, model.blocks):
    for holder, names in ADAPTED.items():
      for name in names:
        linear = getattr(getattr(block, holder), name)
        merged = linear.kernel[...] + linear.lora.lora_a[...] @ linear.lora.lora_b[...]
        getattr(getattr(into, holder), name).kernel[...] = merged


def start(args: argparse.Namespace, preset: Preset, model: Llama,
          fns: list[Callable[..., Any]], params: Params, placement: Placement
          ) -> tuple[list[Callable[..., Any]], Params, FineTuning]:
  """With --init-from: the run's params written into `model` (not on a resume of this run:
  its checkpoint holds them); with --lora, adapters added and the parts split and placed
  again. The layer functions, the params and what trains; unchanged without --init-from."""
  if args.init_from is None:
    return fns, params, FineTuning()
  resumed = (Checkpoints(args.out / "checkpoints", legacy_metadata=args.legacy_metadata)
             .latest_meta() if args.resume else None)
  if resumed is None:
    streams = model.config.depth + (0 if args.plain_ends else 2)
    # The model holds the loaded params: the adapters are added to it, and generation reads
    # its structure.
    step, loaded, rank = load_run(args, preset, model, params, placement, streams)
    meta = {"init_from": str(args.init_from.absolute()), "init_step": step,
            "params_sha256": arrays_sha256(placement.host(loaded))}
    merged = ""
    if rank is not None:  # the run's own params are the merged model's
      fns, params = split(model)
      if args.flat:
        params = [jg.flat.ravel(p, group=flat_group) for p in params]
      params = placement.shard(params)
      meta["merged_lora_rank"] = rank
      meta["merged_params_sha256"] = arrays_sha256(placement.host(params))
      merged = (f"; it is a --lora {rank} run: its adapters merged into the kernels "
                f"(W + A @ B), sha256 {meta['merged_params_sha256'][:12]} merged")
    else:
      params = loaded
    print(f"--init-from {args.init_from}: the params of its step {step} (digests verified), "
          f"sha256 {meta['params_sha256'][:12]}{merged}")
  else:
    meta = dict(resumed[1]["fine_tuning"])
  if args.lora is None:
    return fns, params, FineTuning(None, meta)
  add_adapters(model, args.lora, args.seed)
  fns, params = split(model)
  if args.flat:
    params = [jg.flat.ravel(p, group=adapter_group) for p in params]
  params = placement.shard(params)
  masks = [part_mask(p) for p in params]
  trained = sum(np.size(x) for x in jax.tree.leaves(jg.partition(params, masks)[0]))
  total = sum(np.size(x) for x in jax.tree.leaves(params))
  meta = {**meta, "lora_rank": args.lora, "trained_params": int(trained),
          "base_params_sha256": meta.get("base_params_sha256")
          or frozen_digest(params, masks, placement)}
  print(f"--lora {args.lora}: adapters on the {sum(map(len, ADAPTED.values()))} projections "
        f"of each block: {trained:,} params trained ({trained / total:.1%} of {total:,}); the "
        f"base frozen (grad_mask), sha256 {meta['base_params_sha256'][:12]}")
  return fns, params, FineTuning(masks, meta)
