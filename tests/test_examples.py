"""The examples run: train_gpt and llama/train (tiny presets) train, checkpoint, resume
bitwise and match a whole-step jax.jit; the Llama decode loop does not compile; linen_mlp."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Any

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
  """One persistent compilation cache for the runs: the later ones skip XLA compiles.

  The scripts run where the tests run: the environment tests/conftest.py set up (CPU, or the
  GPU with deterministic reductions, which the bitwise resume check needs), and with this
  checkout's jaxgraph, whatever else is installed.
  """
  cache = tmp_path_factory.mktemp("jax-cache")
  path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
  return {**os.environ, "PYTHONPATH": path, "JAX_COMPILATION_CACHE_DIR": str(cache),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _run(script: str, env: dict[str, str], *args: str) -> str:
  result = subprocess.run([sys.executable, str(EXAMPLES / script), *args], env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout


def test_train_gpt_trains_checkpoints_and_resumes_bitwise(tmp_path, env):
  common = ["--preset", "tiny", "--steps", "12", "--sample", "0"]
  whole, parts = tmp_path / "whole", tmp_path / "parts"
  out = _run("train_gpt.py", env, *common, "--out", str(whole), "--check")
  assert "captures 0  cache hits 1" in out  # the second block reuses the first one's capture
  metrics = json.loads((whole / "metrics.json").read_text())
  losses = metrics["losses"]
  assert len(losses) == 12 and losses[-1] < losses[0]
  assert (whole / "loss.png").read_bytes().startswith(b"\x89PNG")
  assert sorted(p.name for p in (whole / "checkpoints").iterdir() if p.name.isdigit()) == [
      "10", "12"]
  assert set(metrics["layer_ms"]["Block[1]"]) == {"forward", "backward"}
  # One fused whole-step executable may round reductions differently across layer
  # boundaries, so --check is close, not necessarily bitwise (per layer it is: test_flax).
  # On GPU the fusions differ more, and 12 Adam steps carry the difference on: 10x more room.
  assert metrics["check"]["max_loss_diff"] < (1e-4 if jax.default_backend() == "cpu" else 1e-3)

  _run("train_gpt.py", env, *common, "--out", str(parts), "--stop-after", "5")
  assert len(json.loads((parts / "metrics.json").read_text())["losses"]) == 5
  out = _run("train_gpt.py", env, *common, "--out", str(parts), "--resume")
  assert "resumed from step 5" in out
  resumed = json.loads((parts / "metrics.json").read_text())
  assert resumed["losses"] == losses  # floats written from float32: equal means bitwise
  assert resumed["params_sha256"] == metrics["params_sha256"]


def test_llama_trains_matches_whole_step_resumes_bitwise_and_decodes(tmp_path, env):
  # Without excess precision XLA rounds every bf16 value where the program says, also inside
  # one whole-step executable: then the first step is bitwise that of the whole-step jit.
  env = {**env, "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} --xla_allow_excess_precision=false"}
  common = ["--preset", "tiny", "--steps", "12", "--generate", "8"]
  whole, parts = tmp_path / "whole", tmp_path / "parts"
  out = _run("llama/train.py", env, *common, "--out", str(whole), "--check")
  assert "train Block[2]     captures 0  cache hits 1" in out  # blocks share one capture
  metrics = json.loads((whole / "metrics.json").read_text())
  losses, eval_losses = metrics["losses"], metrics["eval_losses"]
  assert len(losses) == 12 and losses[-1] < losses[0]
  assert [step for step, _ in eval_losses] == [6, 12] and eval_losses[1][1] < eval_losses[0][1]
  assert (whole / "loss.png").read_bytes().startswith(b"\x89PNG")
  check = metrics["check"]
  if jax.default_backend() == "cpu":
    assert check["first_step_loss_diff"] == 0 and check["first_step_max_grad_diff"] == 0
  else:  # not measured yet on GPU, where each program may pick other GEMM algorithms
    assert check["first_step_loss_diff"] < 1e-2
  # Later steps differ by rounding (the whole step fuses the optimizer update with the
  # backward), which bf16 training amplifies: 2e-4 after 12 steps when measured.
  assert check["max_loss_diff"] < 1e-2
  # The decode blocks (donating their caches) get a make_graphed call of their own.
  decode = metrics["generation"]["decode_stats"]
  assert decode["Block[0]"]["compiles"] == 1 and decode["Block[0]"]["replays"] == 8
  assert decode["Block[1]"]["compiles"] == 0 and decode["Block[1]"]["cache_hits"] == 1
  assert len(metrics["generation"]["continuation"]) == 8

  _run("llama/train.py", env, *common, "--out", str(parts), "--stop-after", "5")
  out = _run("llama/train.py", env, *common, "--out", str(parts), "--resume")
  assert "resumed from step 5" in out
  resumed = json.loads((parts / "metrics.json").read_text())
  assert resumed["losses"] == losses and resumed["eval_losses"] == eval_losses
  assert resumed["params_sha256"] == metrics["params_sha256"]


def test_llama_flat_params_train_match_whole_step_and_resume_bitwise(tmp_path, env):
  env = {**env, "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} --xla_allow_excess_precision=false"}
  common = ["--preset", "tiny", "--steps", "12", "--generate", "4", "--flat"]
  whole, parts = tmp_path / "whole", tmp_path / "parts"
  out = _run("llama/train.py", env, *common, "--out", str(whole), "--check")
  assert "params held flat: 6 buffers for 20 leaves" in out  # decay / no_decay per part
  metrics = json.loads((whole / "metrics.json").read_text())
  losses = metrics["losses"]
  assert len(losses) == 12 and losses[-1] < losses[0]
  check = metrics["check"]
  if jax.default_backend() == "cpu":
    assert check["first_step_loss_diff"] == 0 and check["first_step_max_grad_diff"] == 0
  else:
    assert check["first_step_loss_diff"] < 1e-2
  assert check["max_loss_diff"] < 1e-2
  # Resume (with the FlatTree params and optimizer state restored by Orbax) from the step-10
  # checkpoint of that run: one run fewer than stopping a second run at a step.
  shutil.copytree(whole, parts)
  shutil.rmtree(parts / "checkpoints" / "12")
  out = _run("llama/train.py", env, *common, "--out", str(parts), "--resume")
  assert "resumed from step 10" in out
  resumed = json.loads((parts / "metrics.json").read_text())
  assert resumed["losses"] == losses and resumed["eval_losses"] == metrics["eval_losses"]
  assert resumed["params_sha256"] == metrics["params_sha256"]


def test_llama_plain_ends_untied_without_dropout(tmp_path, env):
  out = _run("llama/train.py", env, "--preset", "tiny", "--steps", "4", "--generate", "4",
             "--plain-ends", "--untied", "--dropout", "0", "--microbatches", "1",
             "--out", str(tmp_path))
  assert "embedding and head run under plain jax.jit" in out
  metrics = json.loads((tmp_path / "metrics.json").read_text())
  assert metrics["losses"][-1] < metrics["losses"][0]
  assert set(metrics["generation"]["decode_stats"]) == {"Block[0]", "Block[1]"}


@pytest.fixture
def llama(monkeypatch: pytest.MonkeyPatch) -> Any:
  """examples/llama/train.py imported in this process (its model.py as `model`)."""
  monkeypatch.syspath_prepend(str(EXAMPLES / "llama"))
  spec = importlib.util.spec_from_file_location("llama_train", EXAMPLES / "llama" / "train.py")
  train = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, "llama_train", train)  # it defines dataclasses
  spec.loader.exec_module(train)
  yield train
  for name in ("model", "common"):  # the example's own top-level modules
    sys.modules.pop(name, None)


def test_llama_kv_cache_decode_matches_the_full_forward(llama):
  import jax.numpy as jnp
  from flax import nnx

  with jax.default_matmul_precision("highest"):  # float32 dots also on GPU (not TF32)
    config = llama.Config(vocab=13, width=32, depth=2, heads=4, kv_heads=2, hidden=48,
                          compute_dtype=jnp.float32)
    model = llama.Llama(config, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 10), 0, config.vocab)
    expected = model(tokens)  # the plain NNX forward: logits at every position
    fns, params = llama.split(model)
    caches = model.init_cache(1, 10)
    cache = jax.eval_shape(lambda: caches[0])
    prompt = 4
    prefill, decode = (
        llama.build_layers(fns, llama.generation_args(params, config, cache, n),
                           graph_ends=True, inference_only=True) for n in (prompt, 1))

    def run(layers, tokens, positions):
      x = layers[0](params[0], tokens)
      for i, (layer, layer_params) in enumerate(zip(layers[1:-1], params[1:-1])):
        x, caches[i] = layer(layer_params, x, positions, caches[i])
      return layers[-1](params[-1], x[:, -1:], None, params[0]["embedding"][...])[:, 0]

    got = [run(prefill, tokens[:, :prompt], jnp.arange(prompt))]
    got += [run(decode, tokens[:, t:t + 1], jnp.array([t])) for t in range(prompt, 10)]
    # Cached attention is computed differently from the causal one (a mask over the cache):
    # equal up to float32 rounding.
    assert jnp.allclose(jnp.stack(got, 1), expected[:, prompt - 1:], atol=1e-5, rtol=1e-5)
    assert decode[1].stats.compiles == 1 and decode[1].stats.replays == 10 - prompt


def test_linen_mlp_trains(capsys, monkeypatch):
  spec = importlib.util.spec_from_file_location("linen_mlp", EXAMPLES / "linen_mlp.py")
  linen_mlp = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, "linen_mlp", linen_mlp)  # Linen modules are dataclasses
  spec.loader.exec_module(linen_mlp)
  result = linen_mlp.main(["--steps", "30"])  # in this process: no second jax start-up
  assert result["losses"][-1] < result["losses"][0]
  assert "cache hits 1" in capsys.readouterr().out  # the blocks share one capture
