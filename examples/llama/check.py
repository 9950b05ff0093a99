"""--check: the steps the run trained, rerun from the same state and keys under the
whole-step `jax.jit` (`WholeStep`) and compared (the first step's grads, every loss, the
final params), then both steps timed in alternating rounds; what it found is printed
(`report_check`) and goes to metrics.json."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples.checkpoints import Streams
from examples.corpus import Corpus

from .data import step_batches
from .fsdp_report import collectives
from .layers import Params
from .model import Config
from .placement import Placement
from .presets import Preset
from .throughput import describe_rates, rate_summary, throughput_rounds
from .trainer import Grads, Trainer
from .whole_step import WholeStep


class Start(NamedTuple):
  """Where --check's rerun starts: the params and optimizer state on the host (on the device,
  a second copy through the whole run: 12.5 GB more at gpu-1b), and the key streams."""

  params: Params
  opt_state: Any
  streams: Streams


def first_step_grads(trainer: Trainer, params: Params, corpus: Corpus, step: int,
                     positions: jax.Array) -> Grads:
  """The graphed grads of training step `step` (not applied); the key streams are rewound,
  so the training run that follows draws the same keys."""
  streams = trainer.streams()
  total = trainer.grads(params, step_batches(corpus, step, trainer.microbatches), positions)
  trainer.seed(streams)
  return total


def starting_point(placement: Placement, trainer: Trainer, params: Params, opt_state: Any,
                   corpus: Corpus, step: int, positions: jax.Array) -> tuple[Start, Grads]:
  """Before the run trains step `step`: where the rerun starts, and that step's graphed
  grads (`first_step_grads`: not applied), both on the host."""
  start = Start(placement.host(params), placement.host(opt_state), trainer.streams())
  return start, placement.host(first_step_grads(trainer, params, corpus, step, positions))


def max_diff(a: Any, b: Any) -> float:
  return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def compare_with_whole_step(whole: WholeStep, start: Start, corpus: Corpus, steps: range,
                            positions: jax.Array, losses: Sequence[float], first_grads: Grads,
                            params: Params) -> tuple[dict[str, Any], tuple[Params, Any]]:
  """Reruns `steps` from `start` under the whole-step `jax.jit` with the same keys.

  Returns the differences to the graphed run (the first step's summed grads and loss,
  `first_grads`, against the whole step's under one `jax.jit`; every step's loss; the final
  `params`) and the whole step's compile time; and the whole step's final state.
  """
  host = whole.placement.host
  check_params, check_state = whole.placement.put((start.params, start.opt_state))
  whole.seed(start.streams)
  microbatches = whole.microbatches
  total = host(whole.grads(check_params, step_batches(corpus, steps[0], microbatches),
                           positions, whole.bases, whole.counters))
  found: dict[str, Any] = {
      "first_step_loss_diff": abs(float(first_grads[1]) - float(total[1])),
      "first_step_max_grad_diff": max_diff(first_grads[0], total[0])}
  del total
  check_losses = []
  for step in steps:
    check_params, check_state, loss = whole.step(
        check_params, check_state, step_batches(corpus, step, microbatches), positions)
    check_losses.append(loss)
  check_losses = [float(loss) for loss in check_losses]
  found.update({
      "max_loss_diff": max(abs(a - b) for a, b in zip(losses, check_losses)),
      "last_max_param_diff": max_diff(host(params), host(check_params)),
      "whole_step_compile_seconds": round(whole.compile_seconds, 3)})
  return found, (check_params, check_state)


def rerun(fns: Sequence[Callable[..., Any]], config: Config, tx: optax.GradientTransformation,
          preset: Preset, start: Start, first_grads: Grads, *, graph_ends: bool,
          policy: Callable[..., bool] | None, placement: Placement, corpus: Corpus,
          steps: range, positions: jax.Array, losses: Sequence[float], params: Params,
          sharded: dict[str, Any] | None
          ) -> tuple[WholeStep, dict[str, Any], tuple[Params, Any]]:
  """The whole step compiled for the graphed step's shardings (with --fsdp its collectives
  added to `sharded`, `fsdp_report`'s), and `steps` rerun with it from `start` and compared
  (`compare_with_whole_step`): the whole step, what the comparison found, its final state."""
  whole = WholeStep(fns, config, tx, preset.microbatches, start.streams, graph_ends,
                    *placement.abstract((start.params, start.opt_state)),
                    step_batches(corpus, 0, preset.microbatches), positions, policy,
                    placement)
  if placement.mesh is not None:
    sharded["collectives"]["whole_step"] = collectives(whole.compiled)
  found, whole_state = compare_with_whole_step(whole, start, corpus, steps, positions, losses,
                                               first_grads, params)
  return whole, found, whole_state


def time_both(found: dict[str, Any], trainer: Trainer, state: tuple[Params, Any],
              whole: WholeStep, whole_state: tuple[Params, Any], corpus: Corpus,
              positions: jax.Array, preset: Preset) -> dict[str, Any]:
  """`found` with the tokens/s of both steps (`throughput_rounds`), each continuing from its
  final state, which it consumes."""
  found["throughput"] = throughput_rounds(
      {"graphed": (trainer, state), "whole_step": (whole, whole_state)},
      corpus, positions, preset.microbatches, preset.rounds, preset.round_steps)
  found["round_steps"] = preset.round_steps
  return found


def report_check(found: dict[str, Any], loop: dict[str, Any], compute_dtype: Any,
                 steps: int) -> None:
  """Prints what `compare_with_whole_step` found, why it is not bitwise, both throughputs."""
  bitwise = found["first_step_loss_diff"] == 0 and found["first_step_max_grad_diff"] == 0
  print(f"--check against one whole-step jax.jit (compiled in "
        f"{found['whole_step_compile_seconds']:.1f} s), same keys: first step "
        f"{'bitwise equal' if bitwise else 'NOT bitwise equal'} (|loss diff| "
        f"{found['first_step_loss_diff']:.3g}, max |grad diff| "
        f"{found['first_step_max_grad_diff']:.3g}); over {steps} steps max |loss diff| "
        f"{found['max_loss_diff']:.3g}, final max |param diff| "
        f"{found['last_max_param_diff']:.3g}.")
  if not bitwise:
    why = ("where XLA keeps the bf16 activations in excess precision "
           "(XLA_FLAGS=--xla_allow_excess_precision=false rounds them, as the graphed layers "
           "do)" if compute_dtype == jnp.bfloat16 else
           "and its fused kernels sum some products in another order (last-bit differences)")
    print(f"  Not bitwise: the whole step fuses across layer boundaries, {why}. See "
          "docs/llama.md.")
  rates = found["throughput"]
  graphed, whole = (rate_summary(rates[k], found["round_steps"]) for k in ("graphed", "whole_step"))
  print(f"tokens/s, steady state ({len(rates['graphed'])} alternating rounds of "
        f"{found['round_steps']} steps each, after {found['round_steps']} untimed warm-up "
        f"steps; median, spread): graphed {graphed['median']:,.0f} "
        f"({graphed['spread_percent']:.0f}%), whole-step jax.jit {whole['median']:,.0f} "
        f"({whole['spread_percent']:.0f}%), graphed/whole-step "
        f"{graphed['median'] / whole['median']:.3f}; the training loop above: "
        f"{describe_rates(loop)}, graphed")
