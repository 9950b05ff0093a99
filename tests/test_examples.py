"""The examples run: train_gpt and llama/train (tiny presets) train, checkpoint, resume
bitwise and match a whole-step jax.jit; the Llama decode loop does not compile; linen_mlp.
Checkpoints: the history lives in the checkpoint, a corrupt step is named and skipped; flags
are checked before anything runs; the gpu-1b preset has ~1B params and fits 80 GB."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Any

import jax
import numpy as np
import pytest

from processes import free_port, run_processes

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
  """Runs an example; its stdout and stderr (warnings, the bar) together."""
  result = subprocess.run([sys.executable, str(EXAMPLES / script), *args], env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout + result.stderr


def _data_files(step: pathlib.Path) -> list[pathlib.Path]:
  """The array data files of an Orbax step (tensorstore's `d/` chunks), largest first."""
  return sorted((p for p in (step / "state").rglob("d/*") if p.is_file()),
                key=lambda p: -p.stat().st_size)


def _flip_bytes(step: pathlib.Path, count: int = 8) -> None:
  """Flips `count` bytes in the middle of the largest array file of an Orbax step (the
  files stay readable: only a digest can tell)."""
  largest = _data_files(step)[0]
  data = bytearray(largest.read_bytes())
  for i in range(count):
    data[len(data) // 2 + i] ^= 0xFF
  largest.write_bytes(bytes(data))


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
  common = ["--preset", "tiny", "--steps", "12", "--generate", "8", "--no-flat",
            "--residuals", "all"]  # the defaults are flat and recompute: the other test
  whole, parts = tmp_path / "whole", tmp_path / "parts"
  out = _run("llama/train.py", env, *common, "--out", str(whole), "--check", "--rounds", "3",
             "--round-steps", "2")
  assert "train Block[2]     captures 0  cache hits 1" in out  # blocks share one capture
  metrics = json.loads((whole / "metrics.json").read_text())
  # tokens/s: the loop's rounds of 2 steps after 2 warm-up steps; --check's 3 rounds of each.
  assert len(metrics["throughput"]["loop"]["rounds"]) == 5
  assert metrics["tokens_per_second"] == metrics["throughput"]["loop"]["median"]
  assert {k: len(v) for k, v in metrics["check"]["throughput"].items()} == {
      "graphed": 3, "whole_step": 3}
  assert "median of 5 rounds of 2 steps" in out and "3 alternating rounds of 2 steps" in out
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
  # Killed after the checkpoint, before metrics.json: the history is in the checkpoint.
  (parts / "metrics.json").unlink()
  out = _run("llama/train.py", env, *common, "--out", str(parts), "--resume")
  assert "resumed from step 5" in out
  resumed = json.loads((parts / "metrics.json").read_text())
  assert resumed["losses"] == losses and resumed["eval_losses"] == eval_losses
  assert resumed["params_sha256"] == metrics["params_sha256"]

  # --whole-step: the same loop through one jax.jit, the same keys (first step bitwise as
  # --check found), timed the same way.
  step = tmp_path / "step"
  out = _run("llama/train.py", env, "--preset", "tiny", "--steps", "12", "--generate", "0",
             "--whole-step", "--out", str(step))
  assert "--whole-step: training through one whole-step jax.jit" in out
  assert "train Block" not in out  # no graphed training layers captured
  trained = json.loads((step / "metrics.json").read_text())
  assert trained["mode"] == "whole_step" and len(trained["throughput"]["loop"]["rounds"]) == 3
  if jax.default_backend() == "cpu":
    assert trained["losses"][0] == losses[0]
  assert max(abs(a - b) for a, b in zip(trained["losses"], losses)) < 1e-2


def test_llama_flat_params_train_match_whole_step_and_resume_bitwise(tmp_path, env):
  env = {**env, "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} --xla_allow_excess_precision=false"}
  common = ["--preset", "tiny", "--steps", "12", "--generate", "4"]  # flat, recompute: the defaults
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
  # checkpoint of that run: one run fewer than stopping a second run at a step. Step 12 has
  # 8 flipped bytes (it reads, and would train on wrong values): its digests reject it.
  shutil.copytree(whole, parts)
  _flip_bytes(parts / "checkpoints" / "12")
  out = _run("llama/train.py", env, *common, "--out", str(parts), "--resume")
  assert "checkpoint step 12 in" in out and "does not match its digests" in out
  assert "resumed from step 10" in out
  assert (parts / "checkpoints-rejected" / "12").is_dir()
  resumed = json.loads((parts / "metrics.json").read_text())
  assert resumed["losses"] == losses and resumed["eval_losses"] == metrics["eval_losses"]
  assert resumed["params_sha256"] == metrics["params_sha256"]

  # --fuse: the blocks as one executable pair per microbatch, the layers' own kernels (an
  # optimization barrier between blocks): on the CPU the same run, bit for bit.
  fused = tmp_path / "fused"
  _run("llama/train.py", env, *common, "--out", str(fused), "--fuse", "--no-check")
  fused_metrics = json.loads((fused / "metrics.json").read_text())
  assert fused_metrics["config"]["fuse"] is True
  if jax.default_backend() == "cpu":
    assert fused_metrics["losses"] == losses
    assert fused_metrics["params_sha256"] == metrics["params_sha256"]


def test_llama_plain_ends_untied_without_dropout(tmp_path, env):
  out = _run("llama/train.py", env, "--preset", "tiny", "--steps", "4", "--generate", "4",
             "--plain-ends", "--untied", "--dropout", "0", "--microbatches", "1",
             "--out", str(tmp_path))
  assert "embedding and head run under plain jax.jit" in out
  metrics = json.loads((tmp_path / "metrics.json").read_text())
  assert metrics["losses"][-1] < metrics["losses"][0]
  assert set(metrics["generation"]["decode_stats"]) == {"Block[0]", "Block[1]"}


# ------------------------------------------------------------------------------- --fsdp

FSDP = ["--preset", "tiny", "--steps", "12", "--fsdp", "8"]


def _cpu_env(env: dict[str, str], devices: int) -> dict[str, str]:
  """`env` on the CPU backend with `devices` virtual devices (also next to a GPU), bf16
  rounded where the program says (the bitwise comparisons above)."""
  return {**env, "JAX_PLATFORMS": "cpu",
          "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} "
                       "--xla_allow_excess_precision=false"}


def _process(process_id: int, processes: int, port: int) -> list[str]:
  """The flags that make a run process `process_id` of `processes` under `jax.distributed`
  (coordinator on 127.0.0.1:`port`): its CPU collectives then go through gloo."""
  return ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
          "--process-id", str(process_id)]


def _final_params(out: pathlib.Path, step: int) -> dict[str, np.ndarray]:
  """The params of a run's checkpoint `step`, read by Orbax as NumPy arrays, by path."""
  import orbax.checkpoint as ocp

  path = out / "checkpoints" / str(step) / "state"
  checkpointer = ocp.PyTreeCheckpointer()
  tree = checkpointer.metadata(path).item_metadata.tree
  restored = checkpointer.restore(path, restore_args=jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))
  return {jax.tree_util.keystr(k): v
          for k, v in jax.tree_util.tree_flatten_with_path(restored["params"])[0]}


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory,
             env: dict[str, str]) -> tuple[pathlib.Path, dict[str, Any], str]:
  """The tiny preset with --fsdp 8 --check on 8 CPU devices: its --out, metrics, output.

  One process under `jax.distributed`, so that its collectives go through gloo as those of
  the 2-process run do (`test_llama_fsdp_two_processes_agree_with_one` compares them).
  """
  out = tmp_path_factory.mktemp("fsdp8")
  log = _run("llama/train.py", _cpu_env(env, 8), *FSDP, *_process(0, 1, free_port()),
             "--check", "--rounds", "1", "--round-steps", "2", "--generate", "4", "--out",
             str(out))
  return out, json.loads((out / "metrics.json").read_text()), log


def test_llama_fsdp_shards_the_state_and_matches_the_whole_step(fsdp_run):
  out, metrics, log = fsdp_run
  assert "sharded over 8 cpu devices of 1 process(es)" in log
  report = metrics["fsdp"]
  assert report["devices"] == 8 and metrics["config"]["fsdp"] == 8
  arrays = report["arrays"]
  # Every array of the state spans the 8 devices: a buffer of 1024 elements or more is split
  # in 8 (fsdp.shard padded it to a multiple of 8), a smaller one (norm scales) replicated.
  for kind in ("params", "grads", "opt_state"):
    for array in arrays[kind]:
      assert array["devices"] == 8, (kind, array)
      if array["size"] >= 1024:
        assert array["size"] % 8 == 0 and array["shard"] * 8 == array["size"], (kind, array)
      else:
        assert array["shard"] == array["size"], (kind, array)
  split = [(a["path"], a["size"]) for a in arrays["params"] if a["shard"] < a["size"]]
  assert split == [("[0]['decay.float32']", 1984), ("[1]['decay.float32']", 9216),
                   ("[2]['decay.float32']", 9216)]  # the table, each block's matrices
  # A microbatch's grads come back from the pullbacks placed as the params; the AdamW
  # moments are placed as the params too.
  placed = lambda kind: {a["path"]: (a["size"], a["shard"]) for a in arrays[kind]}
  assert placed("grads") == placed("params")
  for moment in (".mu", ".nu"):
    assert {k.split(moment, 1)[1]: v for k, v in placed("opt_state").items()
            if moment in k} == placed("params"), moment
  assert report["state_bytes_unsharded"] / report["state_bytes_per_device"] > 7
  # From each executable's compiled HLO: a block gathers its one sharded buffer once in its
  # forward and once more in its backward (recomputed, not kept), and reduces its grads
  # (reduce-scatter on GPU; all-reduce + dynamic-slice on CPU).
  collectives = report["collectives"]
  assert collectives["Block[1] forward"] == {"all-gather": 1, "reduce-scatter": 0,
                                             "all-reduce": 0}
  backward = collectives["Block[1] backward"]
  assert backward["all-gather"] == 1
  assert backward["reduce-scatter"] + backward["all-reduce"] >= 1
  assert "Block[2] forward" not in collectives  # the blocks replay one executable
  # --check with the same shardings: the losses agree with the whole-step jax.jit. The first
  # step's loss is bitwise equal; its grads are not (largest difference 2.4e-4 when
  # measured): with 8 devices XLA compiles a block's partitioned backward differently in
  # the two programs (docs/fsdp.md); with 1 or 2 devices the first step is bitwise.
  check = metrics["check"]
  assert check["first_step_loss_diff"] == 0
  assert check["first_step_max_grad_diff"] < 1e-3
  assert check["max_loss_diff"] < 1e-2
  losses = metrics["losses"]
  assert len(losses) == 12 and losses[-1] < losses[0]
  assert metrics["stats"]["train Block[1]"]["captures"] == 1  # no recapture across steps
  assert len(metrics["generation"]["continuation"]) == 4


def test_llama_fsdp_resumes_bitwise(fsdp_run, tmp_path, env):
  out, metrics, _ = fsdp_run
  parts = tmp_path / "parts"
  shutil.copytree(out, parts)
  shutil.rmtree(parts / "checkpoints" / "12")  # as if stopped after step 10's checkpoint
  log = _run("llama/train.py", _cpu_env(env, 8), *FSDP, *_process(0, 1, free_port()),
             "--generate", "0", "--out", str(parts), "--resume")
  assert "resumed from step 10" in log  # sharded arrays restored by Orbax, digests verified
  resumed = json.loads((parts / "metrics.json").read_text())
  assert resumed["losses"] == metrics["losses"]
  assert resumed["params_sha256"] == metrics["params_sha256"]


def test_llama_fsdp_two_processes_agree_with_one(fsdp_run, tmp_path, env):
  out, metrics, _ = fsdp_run
  port = free_port()
  logs = run_processes([[sys.executable, str(EXAMPLES / "llama" / "train.py"), *FSDP,
                         *_process(i, 2, port), "--generate", "0", "--out", str(tmp_path)]
                        for i in range(2)], _cpu_env(env, 4), timeout=300)
  for log in logs:
    assert "sharded over 8 cpu devices of 2 process(es)" in log
  found = json.loads((tmp_path / "metrics.json").read_text())  # written by process 0
  assert found["fsdp"]["processes"] == 2
  assert found["stats"]["train Block[1]"]["captures"] == 1
  # The same partitioned programs, and both runs sum across the 8 devices through gloo
  # (fsdp_run is one process under jax.distributed), in the same order: bitwise, every
  # step. Against XLA's in-process collectives (one process without --coordinator) it is
  # not: they add the devices' partial sums in device order, gloo in another, and the
  # gradient clip's global norm differs in its last bit from the first step on, which AdamW
  # carries into every param (docs/fsdp.md: 6e-8 after 12 steps on one machine, 1.7e-4 on
  # another). A wrong shard or a dropped microbatch changes the first loss.
  assert found["losses"] == metrics["losses"]
  assert found["eval_losses"] == metrics["eval_losses"]
  two, one = _final_params(tmp_path, 12), _final_params(out, 12)
  assert two.keys() == one.keys()
  for path in one:
    np.testing.assert_array_equal(two[path], one[path], err_msg=path)


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
      return layers[-1](params[-1], x[:, -1:], None, params[0])[:, 0]  # tied: the embedding

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


# ------------------------------------------------------------- checkpoints, flags, presets


@pytest.fixture
def common(llama: Any) -> Any:
  """examples/common.py, as the Llama example imported it."""
  return sys.modules["common"]


def _state(value: float) -> tuple[Any, Any, list[tuple[jax.Array, int]]]:
  params = {"w": np.full((64, 64), value, np.float32), "b": np.arange(64, dtype=np.float32)}
  return params, {"count": np.asarray(3, np.int32)}, [(jax.random.key(0), 4)]


def _corrupt(kind: str, step: pathlib.Path) -> None:
  files = _data_files(step)
  if kind == "flipped":
    _flip_bytes(step)
  elif kind == "truncated":
    files[0].write_bytes(files[0].read_bytes()[:100])
  elif kind == "deleted":
    files[0].unlink()
  elif kind == "empty_dir":
    shutil.rmtree(step)
    step.mkdir()
  elif kind == "empty_meta":
    (step / "meta" / "metadata").write_bytes(b"")


# Orbax's event loop, closed after a failed read, complains when collected.
unraisable = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@unraisable
@pytest.mark.parametrize("kind", ["flipped", "truncated", "deleted", "empty_dir",
                                  "empty_meta"])
def test_corrupt_latest_checkpoint_is_named_and_the_previous_restored(common, tmp_path, kind):
  checkpoints = common.Checkpoints(tmp_path / "checkpoints")
  for step in (10, 20):
    checkpoints.save(step, *_state(float(step)), {"losses": [1.0] * step})
  _corrupt(kind, tmp_path / "checkpoints" / "20")
  with pytest.warns(common.CheckpointWarning,
                    match=r"checkpoint step 20 in .*; resuming from step 10 instead"):
    restored = common.Checkpoints(tmp_path / "checkpoints").restore(*_state(0.0))
  assert restored.step == 10 and len(restored.meta["losses"]) == 10
  assert np.all(np.asarray(restored.params["w"]) == 10.0)
  assert restored.streams[0][1] == 4
  # The rejected step is out of the way: saving step 20 again works.
  common.Checkpoints(tmp_path / "checkpoints").save(20, *_state(20.0), {"losses": []})
  assert (tmp_path / "checkpoints-rejected" / "20").is_dir()


@unraisable
def test_no_intact_checkpoint_is_one_error(common, tmp_path):
  checkpoints = common.Checkpoints(tmp_path / "checkpoints")
  checkpoints.save(10, *_state(1.0), {"losses": []})
  _flip_bytes(tmp_path / "checkpoints" / "10")
  with pytest.raises(common.NoCheckpoint,
                     match=r"restores intact: step 10 .* Start afresh without --resume"):
    checkpoints.restore(*_state(0.0))
  assert (tmp_path / "checkpoints" / "10").is_dir()  # left in place: maybe the code is wrong


def test_metrics_json_is_written_atomically(common, tmp_path, monkeypatch):
  path = tmp_path / "metrics.json"
  common.write_json(path, {"step": 1})

  def full_disk(*args: Any, **kwargs: Any) -> None:
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(common.json, "dump", full_disk)
  with pytest.raises(OSError):
    common.write_json(path, {"step": 2})
  assert json.loads(path.read_text()) == {"step": 1}  # the old file, whole


@pytest.mark.parametrize("flags, message", [
    (["--seed", "-1"], "--seed takes a number >= 0"),
    (["--dropout", "1.5"], r"--dropout takes a rate in \[0, 1\)"),
    (["--dropout", "-0.1"], r"--dropout takes a rate in \[0, 1\)"),
    (["--generate", "-1"], "--generate takes a number >= 0"),
    (["--temperature", "-1"], "--temperature takes a number >= 0"),
    (["--rounds", "0"], "--rounds takes a number >= 1"),
    (["--round-steps", "0"], "--round-steps takes a number >= 1"),
    (["--whole-step", "--check"], "with --whole-step there is no graphed step"),
    (["--whole-step", "--fuse"], "with --whole-step there are no graphed blocks"),
    (["--dtype", "float32", "--attention", "cudnn"], "pass --attention xla"),
    (["--batch", "0"], "--batch takes a number >= 1"),
    (["--fsdp", "0"], "--fsdp takes a number of devices >= 1"),
    (["--fsdp", "3"], "--fsdp 3 splits each microbatch of 8 sequences over 3 devices: pass "
                      "an N that divides 8"),
    (["--fsdp", "2", "--no-flat"], "--fsdp shards the flat buffers .*: drop --no-flat"),
    (["--preset", "cpu", "--fsdp", "16"], "--fsdp 16 needs 16 devices, found"),
    (["--fsdp", "2", "--coordinator", "127.0.0.1:1"], "pass all three"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"],
     "pass --fsdp N"),
    (["--fsdp", "2", "--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id",
      "2"], "--process-id takes 0 to --num-processes - 1"),
], ids=["seed", "dropout", "negative_dropout", "generate", "temperature", "rounds",
        "round_steps", "whole_step_check", "whole_step_fuse", "cudnn_float32", "batch", "fsdp_zero", "fsdp_batch",
        "fsdp_no_flat", "fsdp_devices", "coordinator_alone", "processes_without_fsdp",
        "process_id"])
def test_llama_flags_are_checked_first(llama, capsys, tmp_path, flags, message):
  with pytest.raises(SystemExit) as exit:
    llama.parse(["--preset", "tiny", "--out", str(tmp_path), *flags])
  assert exit.value.code == 2
  assert re.search(message, capsys.readouterr().err)


def test_llama_resume_checks_the_checkpoints_step_and_config(llama, common, capsys, tmp_path):
  run = ["--preset", "tiny", "--out", str(tmp_path), "--resume"]
  args = llama.parse([*run, "--steps", "40"])  # no checkpoint yet: nothing to compare
  config = llama.run_config(args, llama.resolve(args))
  common.Checkpoints(tmp_path / "checkpoints").save(30, *_state(1.0), {"config": config})

  def refused(*flags: str) -> str:
    with pytest.raises(SystemExit):
      llama.parse([*run, *flags])
    return capsys.readouterr().err

  assert "at step 30, past --steps 12: pass --steps 30 or more" in refused("--steps", "12")
  assert "--stop-after 20 is not after the checkpoint's step 30" in refused(
      "--steps", "40", "--stop-after", "20")
  err = refused("--steps", "40", "--dropout", "0", "--no-flat")
  assert ("--dropout 0.0 (the checkpoint's run: 0.1), --flat False (the checkpoint's run: "
          "True)") in err
  assert "--whole-step True" in refused("--steps", "40", "--whole-step")
  assert "--fsdp 1 (the checkpoint's run: None)" in refused("--steps", "40", "--fsdp", "1")
  assert "--batch 4 (the checkpoint's run: None)" in refused("--steps", "40", "--batch", "4")
  llama.parse([*run, "--steps", "40", "--batch", "8"])  # the tiny preset's batch: the same run
  llama.parse([*run, "--steps", "40", "--rounds", "7"])  # measuring differently is the same run


def test_examples_share_one_progress_bar(common, monkeypatch, capsys):
  for script in (EXAMPLES / "train_gpt.py", EXAMPLES / "llama" / "train.py"):
    source = script.read_text()
    assert "progress_bar(" in source and "class tqdm" not in source, script
    assert "def progress(" not in source, script
  bar = common.progress_bar(range(3, 6), total=5)
  assert type(bar).__module__.startswith("tqdm") and bar.n == 2
  bar.close()
  monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed: log lines only
  bar = common.progress_bar(range(3, 6), total=5)
  assert isinstance(bar, common.LogLines) and list(bar) == [3, 4, 5]
  bar.set_postfix(loss="1.0")
  bar.write("step 5: loss 1.0")
  assert capsys.readouterr().out == "step 5: loss 1.0\n"


def test_gpu_presets_time_steady_state_and_gpu_1b_fits_80gb(llama):
  for name in ("gpu", "gpu-1b"):
    preset = llama.PRESETS[name]
    assert preset.check and preset.rounds >= 5 and preset.round_steps >= 40, name
  for name in ("tiny", "cpu"):  # cheap on CPU: at most 80 timed steps in --check
    assert llama.PRESETS[name].rounds * llama.PRESETS[name].round_steps <= 40, name
  vocab = len(llama.Corpus(llama.CORPUS, 8, 1, 0).chars)
  estimate = llama.memory_estimate(llama.PRESETS["gpu-1b"], vocab)
  assert 0.95e9 < estimate["params"] < 1.1e9, estimate
  # float32 params, AdamW moments, summed and one microbatch's grads, and one microbatch's
  # residuals (jax.vjp's, flash attention), with room for the whole step's temporaries.
  assert estimate["state_bytes"] + estimate["residual_bytes"] < 60e9, estimate
