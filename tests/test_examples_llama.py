"""The Llama example's pieces in this process: the graphed step's grads, the KV-cache
decode, the GPU memory fraction, --offload's spellings, the presets (gpu-1b has ~1B params
and fits 80 GB)."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgraph as jg
from examples_support import EXAMPLES, MEMORY_FRACTION, load_script
from examples_support import llama  # noqa: F401 (pytest fixtures)


@pytest.mark.parametrize("microbatches, tied", [(1, False), (2, True), (4, True)],
                         ids=["1-untied", "2-tied", "4-tied"])
def test_llama_step_sums_its_grads_in_fewer_calls_bitwise(llama, microbatches, tied):
  """The graphed step sums its grads in the executables that take them, two microbatches
  to the first: max(1, M - 1) calls a step before the update's (was M + 1: zeros and one
  sum per microbatch), and two steps' params, optimizer state and losses are bitwise those
  of zeros, `accumulate` per microbatch and `apply_update`, as the whole step sums them.
  The microbatches' grads are given."""
  trainer_lib = llama.trainer
  keys = iter(jax.random.split(jax.random.key(0), 64))
  normal = lambda shape: jax.random.normal(next(keys), shape)  # noqa: E731
  # as the example's --flat params: one buffer per group, sizes as the tiny preset's
  params = [jg.flat.ravel(p, group=trainer_lib.flat_group) for p in (
      {"embedding": normal((62, 32))}, {"kernel": normal((32, 288)), "scale": normal((64,))},
      {"kernel": normal((288, 32)), "scale": normal((32,))})]
  given = [([jax.tree.map(lambda p: normal(p.shape), part) for part in params],
            jax.tree.map(lambda p: normal(p.shape), params[0]) if tied else None,
            normal(()).astype(np.float32)) for _ in range(2 * microbatches)]
  tx = trainer_lib.optimizer(llama.presets.PRESETS["tiny"], 10)  # clipped AdamW, masked
  config = type("Config", (), {"tie_embeddings": tied})()
  trainer = trainer_lib.Trainer([], config, tx, microbatches, params, tx.init(params))
  copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731
  replayed = iter(copy(given))  # the step donates them
  trainer.microbatch = lambda *_: (lambda g: (g[2], g[0], g[1]))(next(replayed))
  calls = []
  for key, compiled in trainer.folds.items():
    trainer.folds[key] = lambda *a, c=compiled, k=key: (calls.append(k), c(*a))[1]
  state = tx.init(params)
  got, expected = (copy(params), copy(state)), (params, state)
  accumulate = jax.jit(trainer_lib.accumulate)
  update = jax.jit(functools.partial(trainer_lib.apply_update, tx, microbatches))
  for step in range(2):
    got = trainer.step(*got[:2], [(None, None)] * microbatches, None)
    total = (jax.tree.map(np.zeros_like, params), np.zeros((), np.float32))
    for grads, table, loss in given[step * microbatches:(step + 1) * microbatches]:
      total = accumulate(total, grads, table, loss)
    expected = update(total, expected[1], expected[0])
    assert all(np.array_equal(a, b)
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)))
  assert len(calls) == 2 * max(1, microbatches - 1)


def test_llama_kv_cache_decode_matches_the_full_forward(llama):
  import jax.numpy as jnp
  from flax import nnx

  with jax.default_matmul_precision("highest"):  # float32 dots also on GPU (not TF32)
    config = llama.model.Config(vocab=13, width=32, depth=2, heads=4, kv_heads=2, hidden=48,
                                compute_dtype=jnp.float32)
    model = llama.model.Llama(config, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 10), 0, config.vocab)
    expected = model(tokens)  # the plain NNX forward: logits at every position
    fns, params = llama.layers.split(model)
    caches = model.init_cache(1, 10)
    cache = jax.eval_shape(lambda: caches[0])
    prompt = 4
    prefill, decode = (
        llama.layers.build_layers(fns, llama.generation.generation_args(params, config, cache, n),
                                  graph_ends=True, inference_only=True) for n in (prompt, 1))

    def run(layers, tokens, positions):
      x = layers[0](params[0], tokens)
      for i, (layer, layer_params) in enumerate(zip(layers[1:-1], params[1:-1])):
        x, caches[i] = layer(layer_params, x, positions, caches[i])
      return layers[-1](params[-1], x[:, -1:], None, params[0])[:, 0]  # tied: the embedding

    got = [run(prefill, tokens[:, :prompt], jnp.arange(prompt))]
    got += [run(decode, tokens[:, t:t + 1], jnp.array([t])) for t in range(prompt, 10)]
    # Cached attention is computed differently from the causal one (a mask over the cache):
    # equal up to float32 rounding.
    assert jnp.allclose(jnp.stack(got, 1), expected[:, prompt - 1:], atol=1e-5, rtol=1e-5)
    assert decode[1].stats.compiles == 1 and decode[1].stats.replays == 10 - prompt


def test_llama_sets_the_gpu_memory_fraction_unless_given(llama, monkeypatch):
  # Set before jax starts a GPU: gpu-1b's --check needs more than JAX's default 75% of 80 GB.
  assert os.environ[MEMORY_FRACTION] == "0.95"
  monkeypatch.setenv(MEMORY_FRACTION, "0.5")
  load_script(monkeypatch, "llama_train_again", EXAMPLES / "llama" / "train.py")
  assert os.environ[MEMORY_FRACTION] == "0.5"  # the user's value is kept


def test_llama_offload_spellings(llama):
  spec, OffloadSpec = llama.offload.offload_spec, llama.offload.OffloadSpec
  assert spec("none") == OffloadSpec("none") and spec("all").kind == "all"
  assert spec("slowdown=5%") == spec("slowdown=0.05") == OffloadSpec("slowdown", 0.05)
  assert spec("memory=4GiB") == OffloadSpec("memory", 4 * 2**30)
  assert spec("memory=512MiB").value == 2**29 and spec("memory=2e9").value == 2e9
  assert spec("memory=1.5GB").value == 1.5e9 and str(spec("slowdown=5%")) == "slowdown=5.0%"


def test_gpu_presets_time_steady_state_and_gpu_1b_fits_80gb(llama):
  presets = llama.presets.PRESETS
  for name in ("gpu", "gpu-1b"):
    preset = presets[name]
    assert preset.check and preset.rounds >= 5 and preset.round_steps >= 40, name
  for name in ("tiny", "cpu"):  # cheap on CPU: at most 80 timed steps in --check
    assert presets[name].rounds * presets[name].round_steps <= 40, name
    assert presets[name].vocab is None  # characters: fast, and the bitwise tests
  for name in ("gpu", "gpu-1b"):  # a subword vocabulary of a real model's size
    assert presets[name].vocab >= 8192 and presets[name].text == "stdlib", name
  estimate = llama.memory.memory_estimate(presets["gpu-1b"], presets["gpu-1b"].vocab)
  assert 0.95e9 < estimate["params"] < 1.1e9, estimate
  # float32 params, AdamW moments, summed and one microbatch's grads, and one microbatch's
  # residuals (jax.vjp's, flash attention), with room for the whole step's temporaries.
  assert estimate["state_bytes"] + estimate["residual_bytes"] < 60e9, estimate
