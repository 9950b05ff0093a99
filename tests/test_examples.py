"""The examples run: train_gpt and llama/train (tiny presets) train, checkpoint, resume
bitwise and match a whole-step jax.jit; the Llama decode loop does not compile; linen_mlp.
The Llama tiny preset computes the golden numbers recorded from an earlier version and
resumes a checkpoint it wrote (tests/llama_golden.py).
Checkpoints: the history lives in the checkpoint, a corrupt step is named and skipped; flags
and `--out` are checked before anything runs; an earlier run is never deleted; a failed write
ends in one message that says how to continue; the gpu-1b preset has ~1B params and fits
80 GB."""

from __future__ import annotations

import errno
import functools
import importlib.util
import json
import logging
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgraph as jg
import llama_golden
from processes import free_port, run_processes

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def env(compilation_cache_env: dict[str, str]) -> dict[str, str]:
  """The environment of the runs: a persistent compilation cache the later ones (and other
  processes of the test run) share, so that they skip XLA compiles.

  The scripts run where the tests run: the environment tests/conftest.py set up (CPU, or the
  GPU with deterministic reductions, which the bitwise resume check needs), and with this
  checkout's jaxgraph, whatever else is installed.
  """
  path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
  return {**os.environ, "PYTHONPATH": path, **compilation_cache_env}


def _run(module: str, env: dict[str, str], *args: str) -> str:
  """Runs an example, `python -m module`; its stdout and stderr (warnings, the bar)
  together."""
  result = subprocess.run([sys.executable, "-m", module, *args], env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout + result.stderr


def _continue(out: str, env: dict[str, str]) -> str:
  """Runs the command a run stopped by --stop-after printed to continue it."""
  command = re.search(r"continue with: (.*)", out).group(1)
  python, m, module, *args = shlex.split(command)
  assert [python, m] == ["python", "-m"] and "--resume" in args and "--stop-after" not in args
  return _run(module, env, *args)


# Runs a script with SIGINT handled as in a terminal (a test runner's child may inherit it
# ignored, which the examples leave ignored).
_SIGINT_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def _interrupted(module: str, env: dict[str, str], at: str, *args: str) -> str:
  """Runs an example that gets Ctrl-C (SIGINT) at `at`: a point of examples/interrupt.py
  (NAME or NAME@STEP), or "compile" (inside an XLA compile). Checks that it ends with one
  line, status 130, no traceback or crash, and no temporary checkpoint folder left in its
  --out; returns that line."""
  result = subprocess.run([sys.executable, "-c", _SIGINT_DEFAULT, "-m", module, *args],
                          env={**env, "EXAMPLES_INTERRUPT_AT": at},
                          capture_output=True, text=True, timeout=600)
  out = result.stdout + result.stderr
  assert result.returncode == 130, out
  assert "Traceback" not in out and "Segmentation" not in out and "Error" not in out, out
  line = result.stderr.strip().splitlines()[-1]
  assert sum("Ctrl-C" in l for l in out.splitlines()) == 1 and "Ctrl-C" in line, out
  checkpoints = pathlib.Path(args[args.index("--out") + 1]) / "checkpoints"
  assert not [p.name for p in checkpoints.glob("*") if not p.name.isdigit()]
  return line


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
  out = _run("examples.train_gpt", env, *common, "--out", str(whole), "--check")
  assert "captures 0  cache hits 1" in out  # the second block reuses the first one's capture
  assert "steps=12," in out  # the header shows the run's steps (the preset's are 30)
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

  # Ctrl-C in the sample of a run stopped at step 5: one line, and the command it names
  # continues the run (Ctrl-C elsewhere: the Llama test below; the same examples/interrupt.py).
  line = _interrupted("examples.train_gpt", env, "generation", *common[:-1], "4", "--out",
                      str(parts), "--stop-after", "5")
  assert line.startswith(f"interrupted (Ctrl-C) during generation: checkpoint step 5 kept "
                         f"({parts.absolute() / 'checkpoints' / '5'}); continue with: python ")
  assert len(json.loads((parts / "metrics.json").read_text())["losses"]) == 5
  out = _continue(line.replace("--sample 4", "--sample 0"), env)
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
  out = _run("examples.llama.train", env, *common, "--out", str(whole), "--check", "--rounds", "3",
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

  out = _run("examples.llama.train", env, *common, "--out", str(parts), "--stop-after", "5")
  assert "stopped after step 5 of 12 (--stop-after); continue with: python " in out
  # Killed after the checkpoint, before metrics.json: the history is in the checkpoint.
  (parts / "metrics.json").unlink()
  out = _continue(out, env)
  assert "resumed from step 5" in out
  resumed = json.loads((parts / "metrics.json").read_text())
  assert resumed["losses"] == losses and resumed["eval_losses"] == eval_losses
  assert resumed["params_sha256"] == metrics["params_sha256"]

  # --whole-step: the same loop through one jax.jit, the same keys (first step bitwise as
  # --check found), timed the same way.
  step = tmp_path / "step"
  out = _run("examples.llama.train", env, "--preset", "tiny", "--steps", "12", "--generate", "0",
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
  out = _run("examples.llama.train", env, *common, "--out", str(whole), "--check")
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
  out = _run("examples.llama.train", env, *common, "--out", str(parts), "--resume")
  assert "checkpoint step 12 in" in out and "does not match its digests" in out
  assert "resumed from step 10" in out
  assert (parts / "checkpoints-rejected" / "12").is_dir()
  resumed = json.loads((parts / "metrics.json").read_text())
  assert resumed["losses"] == losses and resumed["eval_losses"] == metrics["eval_losses"]
  assert resumed["params_sha256"] == metrics["params_sha256"]

  # --offload memory=0: every kept buffer of every block waits in pinned host memory between
  # its forward and backward (the plan for a budget of 0 bytes): the same run, bit for bit.
  offloaded = tmp_path / "offloaded"
  out = _run("examples.llama.train", env, *common, "--out", str(offloaded), "--offload", "memory=0",
             "--no-check")
  assert re.search(r"Block\[0\] +[0-9.]+ +[0-9.]+ +[0-9.]+ +\d+ ", out)  # the measured table
  assert "offload 2 of 2 layers (the first 2)" in out and "of them in host memory" in out
  offload = json.loads((offloaded / "metrics.json").read_text())
  assert offload["offload"]["flags"] == [True, True] and offload["offload"]["min_bytes"] == 0
  moved = [block["moved_bytes"] for block in offload["offload"]["blocks"]]
  assert moved == [sum(block["kept_buffer_bytes"]) for block in offload["offload"]["blocks"]]
  assert [offload["stats"][f"train Block[{i}]"]["offload_bytes"] for i in (1, 2)] == moved
  assert offload["losses"] == losses and offload["params_sha256"] == metrics["params_sha256"]

  # --fuse: the blocks as one executable pair per microbatch, the layers' own kernels (an
  # optimization barrier between blocks): on the CPU the same run, bit for bit.
  fused = tmp_path / "fused"
  _run("examples.llama.train", env, *common, "--out", str(fused), "--fuse", "--no-check")
  fused_metrics = json.loads((fused / "metrics.json").read_text())
  assert fused_metrics["config"]["fuse"] is True
  if jax.default_backend() == "cpu":
    assert fused_metrics["losses"] == losses
    assert fused_metrics["params_sha256"] == metrics["params_sha256"]


def test_llama_plain_ends_untied_without_dropout_subwords_offloaded(tmp_path, env):
  """Also a byte-level BPE vocabulary (trained on the fables into --cache, recorded in the
  checkpoint) and --offload of the blocks in a make_graphed call of their own."""
  out = _run("examples.llama.train", env, "--preset", "tiny", "--steps", "4", "--generate", "4",
             "--plain-ends", "--untied", "--dropout", "0", "--microbatches", "1",
             "--vocab", "300", "--cache", str(tmp_path / "cache"), "--offload", "all",
             "--out", str(tmp_path))
  assert "embedding and head run under plain jax.jit" in out
  assert "steps=4," in out  # the header shows the run's steps (the preset's are 12)
  # The bar counts the steps as they run (it read 0/4 until the end, redrawn only after 1 s).
  assert "4/4 [" in out and not re.search(r" 0/4 \[[^]]*loss=", out)
  assert "vocabulary: a byte-level BPE of 300 tokens" in out and "trained now" in out
  metrics = json.loads((tmp_path / "metrics.json").read_text())
  assert metrics["losses"][-1] < metrics["losses"][0]
  assert set(metrics["generation"]["decode_stats"]) == {"Block[0]", "Block[1]"}
  vocabulary = metrics["vocabulary"]
  assert vocabulary["kind"] == "byte-level BPE" and vocabulary["size"] == 300
  assert vocabulary["text"] == "fables" and pathlib.Path(vocabulary["file"]).is_file()
  assert [metrics["stats"][f"train Block[{i}]"]["offload_bytes"] > 0 for i in (0, 1)] == [
      True, True]
  step, meta = checkpoints_lib.Checkpoints(tmp_path / "checkpoints").latest_meta()
  assert step == 4 and meta["vocabulary"] == vocabulary


def test_llama_lora_fine_tunes_a_trained_run(llama, tmp_path, env):
  """A tiny run, then `--lora 4 --init-from` it into an --out of its own: the base params
  (the run's last checkpoint) stay bitwise what they were, in the checkpoint and by digest
  before and after; the adapters train (Optax over them only) and the held-out loss drops
  from the loaded model's; a LoRA run resumed from its step-10 checkpoint ends bit for bit
  as the uninterrupted one. A LoRA run is an --init-from too (its adapters merged): for LoRA
  on LoRA, and for fine-tuning every param."""
  base, tuned, resumed = tmp_path / "base", tmp_path / "lora", tmp_path / "resumed"
  tiny = ["--preset", "tiny", "--generate", "0"]
  _run("examples.llama.train", env, *tiny, "--out", str(base))
  lora = [*tiny, "--init-from", str(base), "--lora", "4"]
  out = _run("examples.llama.train", env, *lora, "--out", str(tuned))
  trained = json.loads((base / "metrics.json").read_text())
  metrics = json.loads((tuned / "metrics.json").read_text())
  start = metrics["fine_tuning"]
  assert start["init_step"] == 12 and start["lora_rank"] == 4
  assert start["params_sha256"] == trained["params_sha256"]  # the run's last params, loaded
  assert start["base_params_sha256"] == start["base_params_sha256_after"] == (
      trained["params_sha256"])  # the same bytes: the base buffers are the run's
  assert "bitwise as loaded" in out and "the base frozen (grad_mask)" in out
  shape = llama.presets.PRESETS["tiny"]
  w, h, kv = shape.width, shape.hidden, shape.kv_heads * (shape.width // shape.heads)
  shapes = [(w, w), (w, kv), (w, kv), (w, w), (w, h), (w, h), (h, w)]  # q k v out gate up down
  assert start["trained_params"] == shape.depth * sum(4 * (i + o) for i, o in shapes)
  # A block keeps what the base run's does, and each projection's x @ A (rank 4, in the
  # compute dtype) for B's gradient: its output (x @ A) @ B is recomputed, not kept.
  tokens, itemsize = shape.batch * shape.context, np.dtype(jax.numpy.bfloat16).itemsize
  kept, base_kept = (run["stats"]["train Block[1]"]["residual_bytes"]
                     for run in (metrics, trained))
  assert base_kept < kept <= base_kept + len(shapes) * tokens * 4 * itemsize
  # The held-out loss at step 0 is the loaded model's (B = 0: the adapters add nothing), and
  # drops; the train losses are the LoRA run's own.
  eval_losses = metrics["eval_losses"]
  assert [step for step, _ in eval_losses] == [0, 6, 12]
  if jax.default_backend() == "cpu":  # a program with the adapters' matmuls added: bitwise
    assert eval_losses[0][1] == trained["eval_losses"][-1][1]
  assert eval_losses[-1][1] < eval_losses[0][1]
  assert len(metrics["losses"]) == 12
  # In the checkpoint: the base buffers bitwise the run's, the adapters trained.
  params, base_params = _final_params(tuned, 12), _final_params(base, 12)
  for path, value in base_params.items():
    assert np.array_equal(params[path], value), path
  adapters = [path for path in params if "lora" in path]
  assert adapters == ["[1]['lora.float32']", "[2]['lora.float32']"]
  assert all(np.any(params[path] != 0) for path in adapters)

  # A LoRA run is a run to start from: its adapters merged into its kernels (W + A @ B), then
  # new adapters over them (LoRA on LoRA), ...
  stacked = tmp_path / "lora-on-lora"
  out = _run("examples.llama.train", env, *tiny, "--init-from", str(tuned), "--lora", "4", "--steps",
             "2", "--generate", "4", "--out", str(stacked))
  assert "it is a --lora 4 run: its adapters merged into the kernels (W + A @ B)" in out
  assert json.loads((stacked / "metrics.json").read_text())["generation"]["continuation"]
  merged = json.loads((stacked / "metrics.json").read_text())["fine_tuning"]
  assert merged["merged_lora_rank"] == 4 and merged["params_sha256"] == metrics["params_sha256"]
  assert merged["base_params_sha256"] == merged["merged_params_sha256"] == (
      merged["base_params_sha256_after"])  # the merged kernels are the frozen base
  # The merged model computes what the LoRA run's did, to bf16 rounding.
  start_loss = json.loads((stacked / "metrics.json").read_text())["eval_losses"][0]
  assert start_loss[0] == 0 and abs(start_loss[1] - eval_losses[-1][1]) < 1e-2
  # ... or every param trained (the start of such a run, in this process: no adapters left).
  args = llama.cli.parse(["--preset", "tiny", "--init-from", str(tuned), "--out",
                          str(tmp_path / "full")])
  preset = llama.presets.resolve(args)
  corpus, _ = llama.train.load_text(args, preset, None)
  model, fns, full, _ = llama.train.build_model(args, preset, corpus)
  full, placement = llama.train.place(full, args.flat, None, model.config.compute_dtype)
  fns, full, tuning = llama.lora.start(args, preset, model, fns, full, placement)
  assert tuning.masks is None and tuning.meta["merged_lora_rank"] == 4
  assert all(spec.group != "lora" for p in full for spec in p.layout.buffers)
  assert tuning.meta["merged_params_sha256"] == merged["merged_params_sha256"]

  shutil.copytree(tuned, resumed)
  shutil.rmtree(resumed / "checkpoints" / "12")  # as if stopped after step 10's checkpoint
  base.rename(tmp_path / "moved")  # its checkpoints hold the params: no base run needed
  out = _run("examples.llama.train", env, *lora, "--out", str(resumed), "--resume")
  assert "resumed from step 10" in out
  again = json.loads((resumed / "metrics.json").read_text())
  assert again["losses"] == metrics["losses"] and again["eval_losses"] == eval_losses
  assert again["params_sha256"] == metrics["params_sha256"]
  assert again["fine_tuning"] == start


def test_llama_lora_and_init_from_flags_are_checked_first(llama, capsys, tmp_path):
  def refused(*flags: str) -> str:
    with pytest.raises(SystemExit) as exit:
      llama.cli.parse(["--preset", "tiny", "--out", str(tmp_path / "out"), *flags])
    assert exit.value.code == 2
    return capsys.readouterr().err

  run = tmp_path / "run"
  assert "--lora RANK fine-tunes a trained run: pass --init-from RUN_DIR" in refused(
      "--lora", "4")
  assert "--lora takes a rank >= 1, got 0" in refused("--lora", "0", "--init-from", str(run))
  assert ("--lora 17 is above the rank the model's projections can have: the narrowest adapted "
          "one (key/value, 32 x 16) has rank at most 16 (the preset's width is 32)") in refused(
              "--lora", "17", "--init-from", str(run))
  for flags, dropped in ((["--whole-step"], "--whole-step"), (["--check"], "--check"),
                         (["--offload", "all"], "--offload"), (["--fsdp", "2"], "--fsdp")):
    assert f"{dropped} is not supported with it: drop {dropped}" in refused(
        "--init-from", str(run), "--lora", "4", *flags)
  assert f"--init-from: no intact checkpoint in {run / 'checkpoints'}" in refused(
      "--init-from", str(run))
  assert "is this run's --out" in refused("--init-from", str(tmp_path / "out"))
  args = llama.cli.parse(["--preset", "tiny", "--out", str(run)])
  meta = {"config": llama.checkpoints.run_config(args, llama.presets.resolve(args))}
  checkpoints_lib.Checkpoints(run / "checkpoints").save(12, *_state(1.0), {**meta, "losses": [1.0] * 12})
  assert ("--init-from loads params of another model or layout than this run's: --untied "
          f"True (the run in {run}: False), --flat False (the run in {run}: True)") in refused(
              "--init-from", str(run), "--untied", "--no-flat")
  args = llama.cli.parse(["--preset", "tiny", "--out", str(tmp_path / "out"), "--init-from",
                          str(run), "--lora", "4"])
  assert args.check is False  # a LoRA run is not --check'ed, whatever the preset
  # Its metadata passes, its arrays are not this model's: one line when the run loads them.
  preset = llama.presets.resolve(args)
  corpus, _ = llama.train.load_text(args, preset, None)
  model, fns, params, _ = llama.train.build_model(args, preset, corpus)
  params, placement = llama.train.place(params, args.flat, None, model.config.compute_dtype)
  with pytest.raises(SystemExit) as exit:
    llama.lora.start(args, preset, model, fns, params, placement)
  assert exit.value.code == (
      f"--init-from {run}: no checkpoint in {run.absolute() / 'checkpoints'} restores intact: "
      "step 12 holds arrays of other parts or buffers than this run's model (Orbax: the tree "
      "structures do not match); it was saved by a model of other flags or code. Its steps "
      "are left in place: pass the --out of a trained run whose checkpoints restore")


# ------------------------------------------------- the numbers of earlier versions, pinned


def _golden() -> dict[str, Any]:
  """This machine's golden numbers of the tiny preset (tests/llama_golden.py), or a skip that
  says why there are none and how to record them."""
  found = llama_golden.expected()
  if isinstance(found, str):
    pytest.skip(found)
  return found


def test_llama_tiny_preset_computes_the_golden_numbers(tmp_path, env):
  """`--preset tiny` as a user runs it: bit for bit the losses, held-out losses, params and
  generated text the example computed before it became a package of modules (ac11c78;
  tests/data/llama/golden.json says how they were recorded)."""
  golden = _golden()
  _run("examples.llama.train", env, "--preset", "tiny", "--out", str(tmp_path))
  metrics = json.loads((tmp_path / "metrics.json").read_text())
  assert metrics["losses"] == golden["losses"]  # floats from float32: equal means bitwise
  assert metrics["eval_losses"] == golden["eval_losses"]
  assert metrics["params_sha256"] == golden["params_sha256"]
  assert metrics["generation"]["continuation"] == golden["continuation"]


def test_llama_resumes_a_checkpoint_written_before_the_split_through_ctrl_c(llama, capsys, tmp_path,
                                                                           env):
  """The step-10 checkpoint of that golden run, as the example at ac11c78 wrote it, resumes
  with --legacy-metadata (its layout, config, vocabulary and array digests are this
  version's; its metadata has no digest, and is refused without the flag). The resumed run
  gets Ctrl-C inside the capture's first compile, in step 12's evaluation (steps 11 and 12
  trained, not saved) and in its save: each time one line, status 130, and the command it names goes on; the last one
  finds the run finished and writes the missing metrics.json from its checkpoint. Where the
  golden numbers were recorded, the losses are bit for bit the golden run's."""
  shutil.copytree(llama_golden.CHECKPOINT, tmp_path / "checkpoints")
  run = ["--preset", "tiny", "--out", str(tmp_path), "--resume"]
  with pytest.raises(SystemExit):
    llama.cli.parse(run)
  assert (f"--resume: no checkpoint in {tmp_path / 'checkpoints'} has metadata that can be "
          "checked: step 10 has metadata without its digest") in capsys.readouterr().err
  step, saved = checkpoints_lib.Checkpoints(tmp_path / "checkpoints",
                                   legacy_metadata=True).latest_meta()
  assert step == 10
  command = [*run, "--legacy-metadata"]
  kept = f"checkpoint step 10 kept ({tmp_path / 'checkpoints' / '10'})"
  for at, where in (("compile", "capture"), ("evaluation@12", "evaluation (step 12)")):
    line = _interrupted("examples.llama.train", env, at, *command)
    assert line.startswith(f"interrupted (Ctrl-C) during {where}: {kept}; continue with: "
                           "python "), line
    assert line.endswith(shlex.join(command[:-2] + ["--legacy-metadata", "--resume"]))
  line = _interrupted("examples.llama.train", env, "save@12", *command)  # held until it is written
  assert line.startswith("interrupted (Ctrl-C) during a checkpoint save (step 12): every step "
                         f"is trained, checkpoint step 12 kept ({tmp_path / 'checkpoints' / '12'})"
                         "; nothing is left to train"), line
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["10", "12"]
  assert not (tmp_path / "metrics.json").exists()  # the Ctrl-C came before it
  out = _run("examples.llama.train", env, *command)
  assert f"{tmp_path / 'metrics.json'} was missing: written again from step 12's" in out
  metrics = json.loads((tmp_path / "metrics.json").read_text())
  assert metrics["losses"][:10] == saved["losses"] and len(metrics["losses"]) == 12
  golden = llama_golden.expected()
  if not isinstance(golden, str):  # else steps 11 and 12 ran on another machine's numerics
    assert metrics["losses"] == golden["losses"]
    assert metrics["eval_losses"] == golden["eval_losses"]


# ------------------------------------------------------------------------------- --fsdp

FSDP = ["--preset", "tiny", "--steps", "12", "--fsdp", "8"]
# The --fsdp tests on one xdist worker: they share the 8-device run of `fsdp_run`. Their runs
# are on 8 CPU devices on any machine (`_cpu_env`): `cpu_only`.
FSDP_GROUP = pytest.mark.xdist_group("llama-fsdp")


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
  log = _run("examples.llama.train", _cpu_env(env, 8), *FSDP, *_process(0, 1, free_port()),
             "--check", "--rounds", "1", "--round-steps", "2", "--generate", "4", "--out",
             str(out))
  return out, json.loads((out / "metrics.json").read_text()), log


@FSDP_GROUP
@pytest.mark.cpu_only
def test_llama_fsdp_shards_the_state_and_matches_the_whole_step(fsdp_run):
  out, metrics, log = fsdp_run
  assert "sharded over 8 cpu devices of 1 process(es)" in log
  report = metrics["fsdp"]
  assert report["devices"] == 8
  assert metrics["config"]["fsdp"] == {"devices": 8, "layout": "split"}
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
  # By op and element type: XLA:CPU runs the bfloat16 gathers in float32 (bf16 on GPUs).
  collectives = report["collectives"]
  assert collectives["Block[1] forward"] == {"all-gather f32": 1}
  backward = collectives["Block[1] backward"]
  ops = [kind.split()[0] for kind, n in backward.items() for _ in range(n)]
  assert ops.count("all-gather") == 1
  assert ops.count("reduce-scatter") + ops.count("all-reduce") >= 1
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


@FSDP_GROUP
@pytest.mark.cpu_only
def test_llama_fsdp_resumes_bitwise(fsdp_run, tmp_path, env):
  out, metrics, _ = fsdp_run
  parts = tmp_path / "parts"
  shutil.copytree(out, parts)
  shutil.rmtree(parts / "checkpoints" / "12")  # as if stopped after step 10's checkpoint
  log = _run("examples.llama.train", _cpu_env(env, 8), *FSDP, *_process(0, 1, free_port()),
             "--generate", "0", "--out", str(parts), "--resume")
  assert "resumed from step 10" in log  # sharded arrays restored by Orbax, digests verified
  resumed = json.loads((parts / "metrics.json").read_text())
  assert resumed["losses"] == metrics["losses"]
  assert resumed["params_sha256"] == metrics["params_sha256"]


@FSDP_GROUP
@pytest.mark.cpu_only
def test_llama_fsdp_two_processes_agree_with_one(fsdp_run, tmp_path, env):
  out, metrics, _ = fsdp_run
  port = free_port()
  logs = run_processes([[sys.executable, "-m", "examples.llama.train", *FSDP,
                         *_process(i, 2, port), "--generate", "2", "--out", str(tmp_path)]
                        for i in range(2)], _cpu_env(env, 4), timeout=300)
  for log in logs:
    assert "sharded over 8 cpu devices of 2 process(es)" in log
    # Generation's layers, captured for the arrays of this process's first device, replay
    # them on process 1 too (its arrays were taken for placed ones: a recapture warned).
    assert "captured a new input signature" not in log
  # Each line says what its process wrote: loss.png and metrics.json are process 0's.
  assert f"wrote {tmp_path / 'loss.png'}" in logs[0]
  assert "loss.png" not in logs[1].replace("process 0 wrote loss.png", "")
  assert "process 1 wrote its shards of" in logs[1]
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


@FSDP_GROUP
@pytest.mark.cpu_only
def test_llama_fsdp_prefetch_hands_collectives_across_blocks(fsdp_run, tmp_path, env):
  """--prefetch (the default on GPUs): the first block's forward gathers its own buffer and
  the next block's, the last block's gathers none, and the losses follow the unprefetched
  run's (the gradients are reduced in the gather's bfloat16 there, in float32 on the CPU
  unprefetched: docs/fsdp.md)."""
  _, metrics, _ = fsdp_run
  log = _run("examples.llama.train", _cpu_env(env, 8), *FSDP[:-4], "--steps", "2", "--fsdp", "8",
             "--prefetch", "--generate", "0", "--out", str(tmp_path))
  assert "does not trace on the Explicit twin" not in log
  found = json.loads((tmp_path / "metrics.json").read_text())
  collectives = found["fsdp"]["collectives"]
  assert collectives["prefetch(Block[1]) forward"] == {"all-gather f32": 2}
  assert collectives["prefetch(Block[2]) forward"] == {}
  assert not any("all-gather" in kind for kind in collectives["prefetch(Block[2]) backward"])
  assert "Block[1] forward" not in collectives  # the blocks' own executables do not run
  np.testing.assert_allclose(found["losses"], metrics["losses"][:2], rtol=1e-3)


def _load(monkeypatch: pytest.MonkeyPatch, name: str, path: pathlib.Path) -> Any:
  """The example script `path` run again in this process, as a module named `name`."""
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, name, module)  # it defines dataclasses
  spec.loader.exec_module(module)
  return module


MEMORY_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"


@pytest.fixture
def llama(monkeypatch: pytest.MonkeyPatch) -> Any:
  """The Llama example's package, examples/llama/, imported in this process with its train.py
  (`examples.llama.train`, which imports every module): `llama.cli.parse`,
  `llama.layers.split`, `llama.model.Llama`, ... Imported afresh by each test."""
  # The example sets the variable where it is unset: put back as it was after the test.
  monkeypatch.setenv(MEMORY_FRACTION, os.environ.get(MEMORY_FRACTION, ""))
  monkeypatch.delenv(MEMORY_FRACTION)
  importlib.import_module("examples.llama.train")
  yield sys.modules["examples.llama"]
  for name in [name for name in sys.modules if name.startswith("examples.llama")]:
    sys.modules.pop(name)


@pytest.fixture
def gpt() -> Any:
  """examples/train_gpt.py imported in this process."""
  return importlib.import_module("examples.train_gpt")


@pytest.fixture(params=["gpt", "llama"])
def example(request: pytest.FixtureRequest) -> Any:
  """Each training example's command line (`parse`), imported in this process (train_gpt.py;
  the Llama example's cli.py)."""
  module = request.getfixturevalue(request.param)
  return module.cli if request.param == "llama" else module


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


def test_linen_mlp_trains(capsys, monkeypatch):
  spec = importlib.util.spec_from_file_location("linen_mlp", EXAMPLES / "linen_mlp.py")
  linen_mlp = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, "linen_mlp", linen_mlp)  # Linen modules are dataclasses
  spec.loader.exec_module(linen_mlp)
  result = linen_mlp.main(["--steps", "30"])  # in this process: no second jax start-up
  assert result["losses"][-1] < result["losses"][0]
  assert "cache hits 1" in capsys.readouterr().out  # the blocks share one capture


# ------------------------------------------------------------- checkpoints, flags, presets


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
  elif kind == "meta_loss_digit":  # one digit of a saved loss changed: the JSON still reads
    _edit_meta(step, lambda text: text.replace("1.25", "1.75", 1))
  elif kind == "meta_seed_bit":  # one bit of the saved seed flipped: "seed": 0 reads as 1
    _edit_meta(step, lambda text: text.replace('"seed": 0', '"seed": 1', 1))
  elif kind == "meta_digest_renamed":  # its digest's key renamed, a saved loss changed
    _edit_meta(step, lambda text: text.replace('"meta_sha256"', '"meta_sha257"').replace(
        "1.25", "1.75", 1))


def _edit_meta(step: pathlib.Path, edit: Any) -> None:
  """Rewrites the metadata file of an Orbax step with `edit(text)` (which must change it)."""
  path = step / "meta" / "metadata"
  text = path.read_text()
  assert edit(text) != text
  path.write_text(edit(text))


# What each damage reads as: tensorstore's reason, not Orbax's wrapper around it (whose text
# holds a `<bound method ...>` repr). Flipped bytes that land in a compressed chunk of this
# small state fail decompression; elsewhere only the digests tell.
DAMAGE = {"flipped": r"does not match its digests|ValueError: DATA_LOSS",
          "truncated": "ValueError: OUT_OF_RANGE", "deleted": "ValueError: NOT_FOUND",
          "empty_dir": 'KeyError: .Item "meta" was not found', "empty_meta": "JSONDecodeError",
          "meta_loss_digit": "has metadata that does not match its digest",
          "meta_seed_bit": "has metadata that does not match its digest",
          "meta_digest_renamed": "has metadata without its digest .* pass --legacy-metadata"}


def _meta(step: int) -> dict[str, Any]:
  """A run's metadata at `step`: its config (seed 0) and one training loss per step."""
  return {"config": {"seed": 0}, "losses": [1.25] * step}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_corrupt_latest_checkpoint_is_named_and_the_previous_restored(tmp_path, kind):
  checkpoints = checkpoints_lib.Checkpoints(tmp_path / "checkpoints")
  for step in (10, 20):
    checkpoints.save(step, *_state(float(step)), _meta(step))
  _corrupt(kind, tmp_path / "checkpoints" / "20")
  # The look before anything is built reads the newest step whose metadata is whole.
  latest = checkpoints_lib.Checkpoints(tmp_path / "checkpoints").latest_meta()
  assert latest[0] == (20 if kind in ("flipped", "truncated", "deleted") else 10)
  with pytest.warns(checkpoints_lib.CheckpointWarning,
                    match=r"checkpoint step 20 in .*; resuming from step 10 instead") as found:
    restored = checkpoints_lib.Checkpoints(tmp_path / "checkpoints").restore(*_state(0.0))
  (warning,) = found
  assert re.search(DAMAGE[kind], str(warning.message))
  assert "bound method" not in str(warning.message)
  assert restored.step == 10 and len(restored.meta["losses"]) == 10
  assert np.all(np.asarray(restored.params["w"]) == 10.0)
  assert restored.streams[0][1] == 4
  # The rejected step is out of the way: saving step 20 again works.
  checkpoints_lib.Checkpoints(tmp_path / "checkpoints").save(20, *_state(20.0), _meta(20))
  assert (tmp_path / "checkpoints-rejected" / "20").is_dir()


def test_a_history_that_does_not_fit_its_step_is_rejected(tmp_path):
  """A loss dropped from a step's metadata: with the metadata's digest, the digest tells;
  in a step saved before metadata digests (none in it), read with --legacy-metadata (else
  refused: `test_corrupt_latest_checkpoint_is_named_and_the_previous_restored`), the count
  of losses does."""
  checkpoints = checkpoints_lib.Checkpoints(tmp_path / "checkpoints", keep=3)
  for step in (10, 20, 30):
    checkpoints.save(step, *_state(float(step)), _meta(step))
  for step, keep_digest in ((30, True), (20, False)):
    path = tmp_path / "checkpoints" / str(step) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta["losses"].pop()
    if not keep_digest:
      del meta[checkpoint_checks.META_DIGEST]
    path.write_text(json.dumps(meta))
  with pytest.warns(checkpoints_lib.CheckpointWarning) as found:
    restored = checkpoints_lib.Checkpoints(tmp_path / "checkpoints",
                                  legacy_metadata=True).restore(*_state(0.0))
  assert restored.step == 10 and len(restored.meta["losses"]) == 10
  assert [str(w.message).split(";")[0] for w in found] == [
      f"checkpoint step 30 in {tmp_path / 'checkpoints'} has metadata that does not match its "
      "digest (its config, loss history or array digests were changed after the save)",
      f"checkpoint step 20 in {tmp_path / 'checkpoints'} has metadata holding 19 training "
      "losses for its 20 steps"]


def test_the_newest_checkpoints_are_kept_as_asked(tmp_path):
  checkpoints = checkpoints_lib.Checkpoints.for_run(tmp_path, fresh=False, command="", keep=3)
  for step in (10, 20, 30, 40):
    checkpoints.save(step, *_state(float(step)), _meta(step))
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [20, 30, 40]
  assert checkpoints.kept() == "the newest 3 steps kept: --keep-checkpoints N keeps more"
  assert checkpoints_lib.Checkpoints(tmp_path / "other").kept().startswith("the newest 2 steps kept")


def test_no_intact_checkpoint_is_one_error(tmp_path):
  checkpoints = checkpoints_lib.Checkpoints(tmp_path / "checkpoints")
  checkpoints.save(10, *_state(1.0), _meta(10))
  _flip_bytes(tmp_path / "checkpoints" / "10")
  with pytest.raises(checkpoints_lib.NoCheckpoint, match=r"restores intact: step 10 ") as found:
    checkpoints.restore(*_state(0.0))
  assert "--fresh" not in str(found.value)  # advice is the caller's: --resume's, below
  with pytest.raises(SystemExit, match=r"^--resume: no checkpoint .* start afresh with --fresh "
                     r"instead of --resume \(they are moved aside, not deleted\)$"):
    checkpoints.resume(*_state(0.0))
  assert (tmp_path / "checkpoints" / "10").is_dir()  # left in place: maybe the code is wrong


def test_metrics_json_is_written_atomically(tmp_path, monkeypatch):
  path = tmp_path / "metrics.json"
  records.write_json(path, {"step": 1})

  def full_disk(*args: Any, **kwargs: Any) -> None:
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(records.json, "dump", full_disk)
  with pytest.raises(OSError):
    records.write_json(path, {"step": 2})
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
    (["--fuse", "0"], "--fuse: takes a number of blocks >= 1, got 0"),
    (["--fuse", "two"], "--fuse: takes a number of blocks, got 'two'"),
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
    (["--context", "0"], "--context takes a number >= 1"),
    (["--vocab", "257"], "--vocab takes a number of tokens above 257 .*, or 'chars'"),
    (["--offload", "some"], r"--offload takes none, all, slowdown=P% .* got 'some'"),
    (["--offload", "memory=5%"], r"--offload takes none, all, slowdown=P%"),
    (["--offload", "slowdown=20"], r"--offload slowdown= takes a fraction of the step in "
                                   r"\[0, 10\)"),
    (["--offload", "all", "--whole-step"], "--whole-step trains through one jax.jit, with no "
                                           "graphed blocks: drop one of them"),
    (["--offload", "all", "--fuse"], "--fuse replays the blocks as one executable"),
    (["--offload", "slowdown=5%", "--fsdp", "2"], "--fsdp shards the blocks over devices"),
    (["--stop-after", "13"], r"--stop-after 13 is past the run's last step \(--steps 12\): "
                             "pass a --stop-after of at most 12"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints takes a number >= 1"),
], ids=["seed", "dropout", "negative_dropout", "generate", "temperature", "rounds",
        "round_steps", "whole_step_check", "whole_step_fuse", "fuse_zero", "fuse_word",
        "cudnn_float32", "batch", "fsdp_zero", "fsdp_batch",
        "fsdp_no_flat", "fsdp_devices", "coordinator_alone", "processes_without_fsdp",
        "process_id", "context", "vocab", "offload_spelling", "offload_unit",
        "offload_slowdown", "offload_whole_step", "offload_fuse", "offload_fsdp",
        "stop_after_past_steps", "keep_checkpoints"])
def test_llama_flags_are_checked_first(llama, capsys, tmp_path, flags, message):
  with pytest.raises(SystemExit) as exit:
    llama.cli.parse(["--preset", "tiny", "--out", str(tmp_path), *flags])
  assert exit.value.code == 2
  assert re.search(message, capsys.readouterr().err)


def test_llama_resume_checks_the_checkpoints_step_and_config(llama, capsys, tmp_path):
  run = ["--preset", "tiny", "--out", str(tmp_path), "--resume"]
  args = llama.cli.parse([*run, "--steps", "40"])  # no checkpoint yet: nothing to compare
  config = llama.checkpoints.run_config(args, llama.presets.resolve(args))
  checkpoints_lib.Checkpoints(tmp_path / "checkpoints").save(30, *_state(1.0), {"config": config})

  def refused(*flags: str) -> str:
    with pytest.raises(SystemExit):
      llama.cli.parse([*run, *flags])
    return capsys.readouterr().err

  assert "at step 30, past --steps 12: pass --steps 30 or more" in refused("--steps", "12")
  assert "--stop-after 20 is not after the checkpoint's step 30" in refused(
      "--steps", "40", "--stop-after", "20")
  err = refused("--steps", "40", "--dropout", "0", "--no-flat")
  assert ("--dropout 0.0 (the checkpoint's run: 0.1), --flat False (the checkpoint's run: "
          "True)") in err
  assert "--whole-step True" in refused("--steps", "40", "--whole-step")
  assert "--fsdp 1 (the checkpoint's run: off)" in refused("--steps", "40", "--fsdp", "1")
  # The checkpoint's batch is the preset's: named as such, not as the None saved for it.
  assert "--batch 4 (the checkpoint's run: 8)" in refused("--steps", "40", "--batch", "4")
  assert "--residuals all (the checkpoint's run: recompute)" in refused(
      "--steps", "40", "--residuals", "all")
  llama.cli.parse([*run, "--steps", "40", "--batch", "8"])  # the tiny preset's: the same run
  llama.cli.parse([*run, "--steps", "40", "--rounds", "7"])  # measured otherwise: the same run
  # An --fsdp checkpoint of buffers in the earlier layout (saved as "fsdp": N) holds the same
  # shapes in another order: refused, not resumed into scrambled weights.
  fsdp_run = [*run, "--steps", "40", "--fsdp", "1"]
  fsdp_args = llama.cli.parse(["--preset", "tiny", "--out", str(tmp_path / "new"), "--steps",
                               "40", "--fsdp", "1"])
  sharded = llama.checkpoints.run_config(fsdp_args, llama.presets.resolve(fsdp_args))
  checkpoints_lib.Checkpoints(tmp_path / "checkpoints").save(31, *_state(1.0),
                                                    {"config": {**sharded, "fsdp": 1}})
  assert ("--fsdp 1 (the checkpoint's run: 1, its flat buffers in the layout before "
          "jg.flat.split's)") in refused(*fsdp_run[len(run):])
  checkpoints_lib.Checkpoints(tmp_path / "checkpoints").save(32, *_state(1.0), {"config": sharded})
  llama.cli.parse(fsdp_run)  # this layout: the same run


def test_llama_resume_reads_verified_metadata_and_stops_a_finished_run_first(llama, capsys, tmp_path):
  """A flipped bit in the newest step's saved seed: its metadata fails its digest, so the
  look before anything is built compares the step before it (which the resume will
  restore), and names the seed that run trained with. An intact step at --steps: nothing
  left to train, said before anything is built; with that step damaged, the resume goes on
  (it trains from the step before)."""
  run = ["--preset", "tiny", "--out", str(tmp_path), "--resume", "--steps", "40"]
  args = llama.cli.parse(run)
  meta = {"config": llama.checkpoints.run_config(args, llama.presets.resolve(args))}
  checkpoints = checkpoints_lib.Checkpoints(tmp_path / "checkpoints")
  for step in (30, 40):
    checkpoints.save(step, *_state(float(step)), {**meta, "losses": [1.25] * step})
  _corrupt("meta_seed_bit", tmp_path / "checkpoints" / "40")
  with pytest.raises(SystemExit):
    llama.cli.parse([*run, "--seed", "1"])
  assert "--seed 1 (the checkpoint's run: 0)" in capsys.readouterr().err
  assert llama.cli.parse(run).seed == 0  # step 30's run: resumes (step 40 rejected then)

  finished = tmp_path / "finished"
  checkpoints_lib.Checkpoints(finished / "checkpoints").save(40, *_state(1.0),
                                                    {**meta, "losses": [1.25] * 40})
  (finished / "metrics.json").write_text("{}")  # damaged: restored from the checkpoint
  finish = f"To train on from its params, start a new run from it: --init-from {finished} " \
           "and another --out"
  for written in (f", and {finished / 'metrics.json'} was damaged: written again from step "
                  "40's checkpoint (its step and losses; the run's other records, such as "
                  "tokens/s, are not in checkpoints).", " or written."):
    with pytest.raises(SystemExit) as exit:
      llama.cli.parse([*run[:2], "--out", str(finished), *run[4:]])
    assert exit.value.code in (0, None)
    assert capsys.readouterr().out.strip() == (
        f"--resume: the checkpoint in {finished / 'checkpoints'} is at step 40, the run's "
        f"last (--steps 40): nothing left to train; nothing was built{written} {finish}")
    assert json.loads((finished / "metrics.json").read_text()) == {
        "step": 40, "losses": [1.25] * 40}
  _flip_bytes(finished / "checkpoints" / "40")
  llama.cli.parse([*run[:2], "--out", str(finished), *run[4:]])  # goes on to the resume


OTHER_SHAPES = """
import pathlib, sys
import jax, numpy as np
from examples.checkpoints import Checkpoints
out = pathlib.Path(sys.argv[1])
key = [(jax.random.key(0), 4)]
for step in (10, 20):
  Checkpoints(out).save(step, {"w": np.ones((64, 64), np.float32), "b": np.ones(64)}, {}, key,
                        {"losses": [1.0] * step})
Checkpoints(out).resume({"w": np.ones((64, 32), np.float32), "b": np.ones(64)}, {}, key)
"""


def test_a_resume_of_a_model_of_other_shapes_is_one_message(tmp_path):
  """A resume whose model has other shapes (a width, hidden size or kv heads changed) than
  the one that saved the checkpoints: one line naming the arrays, no TensorStore
  tracebacks (it used to read each array and fail, 12-27 of them printed), nothing moved."""
  result = subprocess.run([sys.executable, "-c", OTHER_SHAPES, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 1 and result.stdout == ""
  (line,) = result.stderr.strip().splitlines()
  shapes = ("holds arrays of other shapes than this run's model: ['params']['w'] is "
            "float32[64, 64] there, float32[64, 32] here; it was saved by a model of another "
            "shape (width, hidden, heads or vocabulary)")
  assert line == (f"--resume: no checkpoint in {tmp_path} restores intact: step 20 {shapes}; "
                  f"step 10 {shapes}. The steps are left in place: resume with the model "
                  "(code, preset and flags) that saved them, or start afresh with --fresh "
                  "instead of --resume (they are moved aside, not deleted)")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["10", "20"]


# ------------------------------------------------------------ --out: nothing deleted, faults


def _refused(example: Any, capsys: pytest.CaptureFixture, *flags: str) -> str:
  """The one-line argparse error `example` exits with for `flags` (tiny preset)."""
  with pytest.raises(SystemExit) as exit:
    example.parse(["--preset", "tiny", *flags])
  assert exit.value.code == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err
  return err


def test_an_earlier_run_is_refused_and_fresh_moves_it_aside(example, capsys, tmp_path):
  out = tmp_path / "run"
  example.parse(["--preset", "tiny", "--out", str(out)])  # nothing there yet
  checkpoints = checkpoints_lib.Checkpoints(out / "checkpoints")
  for step in (10, 20):
    checkpoints.save(step, *_state(float(step)), {"losses": [1.0] * step})
  records.write_json(out / "metrics.json", {"step": 20})
  # The same command again: refused, naming both ways on (it used to delete the checkpoints).
  assert (f"--out {out} holds an earlier run (checkpoints of steps 10, 20; metrics.json): pass "
          f"--resume to continue it, --fresh to start afresh (it is moved to "
          f"{out / 'earlier-1'}, not deleted), or another --out") in _refused(
              example, capsys, "--out", str(out))
  assert "pass one of them" in _refused(example, capsys, "--out", str(out), "--resume",
                                        "--fresh")
  assert {p.name for p in out.iterdir()} == {"checkpoints", "metrics.json"}
  args = example.parse(["--preset", "tiny", "--out", str(out), "--fresh"])
  checkpoints_lib.Checkpoints.for_run(args.out, fresh=args.fresh, command="")
  assert f"the earlier run in {out} moved to {out / 'earlier-1'}" in capsys.readouterr().out
  kept = out / "earlier-1"
  assert {p.name for p in kept.iterdir()} == {"checkpoints", "metrics.json"}
  restored = checkpoints_lib.Checkpoints(kept / "checkpoints").restore(*_state(0.0))
  assert restored.step == 20 and len(restored.meta["losses"]) == 20  # intact
  assert checkpoints_lib.earlier_run(out) == []
  example.parse(["--preset", "tiny", "--out", str(out)])  # a new run goes on without a flag
  records.write_json(out / "metrics.json", {"step": 1})
  checkpoints_lib.Checkpoints.for_run(out, fresh=True, command="")
  assert (out / "earlier-2" / "metrics.json").is_file()  # the next --fresh: the next folder


@pytest.mark.parametrize("case", ["out_is_a_file", "out_under_a_file", "checkpoints_is_a_file",
                                  "out_read_only", "checkpoints_read_only"])
def test_out_is_checked_before_anything_is_built(example, capsys, monkeypatch, tmp_path, case):
  out = tmp_path / "run"
  if case == "out_is_a_file":
    out.write_text("")
    expected = f"--out: {out} is a file, not a directory: pass an --out that is a directory"
  elif case == "out_under_a_file":
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "run"
    expected = f"--out: cannot write to {out} (Not a directory): pass an --out you can write to"
  elif case == "checkpoints_is_a_file":
    out.mkdir()
    (out / "checkpoints").write_text("")
    expected = f"--out: {out / 'checkpoints'} is a file, not a directory"
  else:
    # The tests run as root, for whom no directory is read-only: the probe fails as it does
    # on a read-only filesystem (a read-only checkpoints/ failed only at the first save).
    where = out if case == "out_read_only" else out / "checkpoints"
    real = tempfile.TemporaryFile

    def read_only(*args: Any, dir: str, **kwargs: Any) -> Any:
      if pathlib.Path(dir) == where:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), dir)
      return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(options.tempfile, "TemporaryFile", read_only)
    expected = f"--out: cannot write to {where} (Read-only file system)"
  assert expected in _refused(example, capsys, "--out", str(out))


def test_a_failed_save_ends_in_one_message_naming_the_last_step_saved(tmp_path,
                                                                      monkeypatch, caplog):
  checkpoints = checkpoints_lib.Checkpoints(tmp_path / "checkpoints", command="python train.py --resume")
  checkpoints.save(10, *_state(1.0), {"losses": []})

  def full_disk(step: int, args: Any) -> bool:
    # As Orbax fails on a full disk: its writer threads log an error with a traceback, then
    # the save raises its wrapper of tensorstore's error.
    logging.getLogger("absl").error("_SignalingThread.run() raised an exception: ...")
    try:
      raise ValueError("RESOURCE_EXHAUSTED: Error writing ...: No space left on device "
                       "[os_error_code='28']")
    except ValueError as e:
      raise Exception("Encountered error while writing: <bound method ...>") from e

  monkeypatch.setattr(checkpoints.manager, "save", full_disk)
  with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exit:
    checkpoints.save(20, *_state(2.0), {"losses": []})
  assert exit.value.code == (
      f"could not save checkpoint step 20 in {tmp_path / 'checkpoints'}: ValueError: "
      "RESOURCE_EXHAUSTED: Error writing ...: No space left on device [os_error_code='28']. "
      f"The last step saved is 10 ({tmp_path / 'checkpoints' / '10'}); free space on its "
      "disk, continue with: python train.py --resume")
  assert not caplog.records  # Orbax's error log held: the message says it


def test_a_full_disk_writing_metrics_ends_in_one_message(tmp_path, monkeypatch):
  path = tmp_path / "metrics.json"
  checkpoints = checkpoints_lib.Checkpoints(tmp_path / "checkpoints", command="python train.py --resume")
  with pytest.raises(SystemExit) as exit, checkpoints.writing(path):
    records.write_json(path, {"step": 1})  # fine
    assert json.loads(path.read_text()) == {"step": 1}

    def full_disk(*args: Any, **kwargs: Any) -> None:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(records.json, "dump", full_disk)
    records.write_json(path, {"step": 2})
  assert exit.value.code == (f"could not write {path}: OSError: [Errno 28] No space left on "
                             "device. No step is saved yet; free space on its disk, continue "
                             "with: python train.py --resume")
  assert json.loads(path.read_text()) == {"step": 1}  # the old file, whole
  assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["metrics.json"]  # no .tmp


def _small_disk(path: pathlib.Path, size: str) -> None:
  """Mounts a tmpfs of `size` at `path` (root on Linux), or skips the test."""
  path.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           capture_output=True, text=True)
  if mounted.returncode:
    pytest.skip(f"cannot mount a small filesystem here: {mounted.stderr.strip()}")


FILL_THE_DISK = """
import pathlib, sys
import jax, numpy as np
from examples.checkpoints import Checkpoints
out = pathlib.Path(sys.argv[1])
checkpoints = Checkpoints(out / "checkpoints", command="python train.py --resume")
key = [(jax.random.key(0), 4)]
checkpoints.save(10, {"w": np.ones((64, 64), np.float32)}, {}, key, {"losses": []})
noise = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)  # 4 MB
checkpoints.save(20, {"w": noise}, {}, key, {"losses": []})
"""


def test_a_full_disk_during_a_save_prints_one_message_and_nothing_else(tmp_path):
  disk = tmp_path / "disk"
  _small_disk(disk, "1m")
  try:
    result = subprocess.run([sys.executable, "-c", FILL_THE_DISK, str(disk)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert (disk / "checkpoints" / "10").is_dir()  # the step before is intact
  finally:
    subprocess.run(["umount", str(disk)], check=True)
  # Was: the error's traceback, Orbax's logged tracebacks, "Event loop is closed" and
  # "sys.meta_path is None" at exit.
  assert result.returncode == 1 and result.stdout == ""
  (line,) = result.stderr.strip().splitlines()
  assert line.startswith(f"could not save checkpoint step 20 in {disk / 'checkpoints'}: "
                         "ValueError: RESOURCE_EXHAUSTED: ")
  # tensorstore's own words between the two differ by version (the GPU machine's added to them).
  assert "No space left on device" in line
  assert line.endswith(f". The last step saved is 10 ({disk / 'checkpoints' / '10'}); free space "
                       "on its disk, continue with: python train.py --resume")


def test_llama_on_a_full_disk_ends_in_one_message(tmp_path, env):
  """The tiny Llama run on a disk with room for one and a half checkpoints: step 10 saves,
  step 12 fails part-way. One message, no traceback (it was 87 lines with 11 tracebacks:
  Orbax's writes still in flight calling into its closed event loop, and asyncio's log of
  their futures at exit)."""
  page = 4096  # tmpfs holds whole pages
  step_bytes = sum(-(-f.stat().st_size // page) * page
                   for f in (llama_golden.CHECKPOINT / "10").rglob("*") if f.is_file())
  disk = tmp_path / "disk"
  _small_disk(disk, f"{step_bytes * 3 // 2 // 1024}k")
  try:
    result = subprocess.run([sys.executable, "-m", "examples.llama.train", "--preset",
                             "tiny", "--generate", "0", "--out", str(disk / "run")], env=env,
                            capture_output=True, text=True, timeout=600)
    assert (disk / "run" / "checkpoints" / "10").is_dir()
  finally:
    subprocess.run(["umount", str(disk)], check=True)
  out = result.stdout + result.stderr
  assert result.returncode == 1, out
  for noise in ("Traceback", "Event loop is closed", "never retrieved", "Exception ignored"):
    assert noise not in out, out
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith(f"could not save checkpoint step 12 in {disk / 'run' / 'checkpoints'}"
                         ": ValueError: RESOURCE_EXHAUSTED: ") and "No space left on device" in last
  assert re.search(re.escape(f"The last step saved is 10 ({disk / 'run' / 'checkpoints' / '10'}"
                             "); free space on its disk, continue with: python ") + r"\S+"
                   + re.escape(f"train.py --preset tiny --generate 0 --out {disk / 'run'} "
                               "--resume") + "$", last), last


def test_closed_event_loop_callbacks_are_dropped_and_other_unraisables_kept(monkeypatch):
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  checkpoint_checks.quiet_closed_loops()
  checkpoint_checks.quiet_closed_loops()  # once is enough: not wrapped twice
  hook = sys.unraisablehook
  assert hook.__closure__[0].cell_contents == seen.append

  def unraisable(error: BaseException) -> Any:
    return type("Unraisable", (), {"exc_type": type(error), "exc_value": error,
                                   "exc_traceback": None, "err_msg": None, "object": None})

  for error in (RuntimeError("Event loop is closed"),
                ImportError("sys.meta_path is None, Python is likely shutting down")):
    hook(unraisable(error))  # Orbax's callbacks after a failed read or write
  assert seen == []
  other = unraisable(RuntimeError("something else"))
  hook(other)
  assert seen == [other]


def test_ctrl_c_inside_a_write_waits_for_it():
  """examples/interrupt.py's handler: Ctrl-C inside `held()` (a save, metrics.json) is raised
  when the write is done; elsewhere at once (the runs above: `_interrupted`)."""
  written = []
  with pytest.raises(KeyboardInterrupt):
    with interrupt.held():
      with interrupt.held():  # nested: the outermost write ends first
        interrupt._handler(signal.SIGINT, None)
        written.append("inner")
      written.append("outer")
  assert written == ["inner", "outer"] and not interrupt.RUN.pending
  with pytest.raises(KeyboardInterrupt):
    interrupt._handler(signal.SIGINT, None)


def test_resume_command_continues_the_run():
  module = "examples.llama.train"
  assert options.resume_command(module, [
      "--preset", "tiny", "--stop-after", "5", "--out", "a b", "--fresh"]) == (
          "python -m examples.llama.train --preset tiny --out 'a b' --resume")
  assert options.resume_command(module, ["--stop-after=5", "--resume"]) == (
      "python -m examples.llama.train --resume")


def _documented_runs(page: pathlib.Path, module: str) -> list[list[str]]:
  """The flags of every command of `page`'s shell blocks that runs `module`, in order."""
  runs, fence = [], None
  for line in page.read_text().replace("\\\n", " ").splitlines():
    if line.startswith("```"):
      fence = None if fence is not None else line[3:] or "text"
    elif fence in ("bash", "sh"):
      words = shlex.split(line, comments=True)
      runs += [words[i + 1:] for i, word in enumerate(words) if word == module]
  return runs


@pytest.mark.parametrize("page, module, default", [
    ("docs/quickstart.md", "examples.train_gpt", "runs/gpt"),
    ("docs/llama.md", "examples.llama.train", "runs/llama"),
    ("README.md", "examples.train_gpt", "runs/gpt")])
def test_documented_commands_run_in_order_meet_no_earlier_run(page, module, default):
  # Each command that starts a run (no --resume, no --fresh) needs an --out no command
  # before it wrote: else it is refused (it used to delete the earlier run's checkpoints).
  used = set()
  runs = _documented_runs(ROOT / page, module)
  assert runs, page
  for flags in runs:
    out = flags[flags.index("--out") + 1] if "--out" in flags else default
    if not {"--resume", "--fresh"} & set(flags):
      assert out not in used, (page, flags)
    used.add(out)


def test_llama_sets_the_gpu_memory_fraction_unless_given(llama, monkeypatch):
  # Set before jax starts a GPU: gpu-1b's --check needs more than JAX's default 75% of 80 GB.
  assert os.environ[MEMORY_FRACTION] == "0.95"
  monkeypatch.setenv(MEMORY_FRACTION, "0.5")
  _load(monkeypatch, "llama_train_again", EXAMPLES / "llama" / "train.py")
  assert os.environ[MEMORY_FRACTION] == "0.5"  # the user's value is kept


def test_llama_offload_spellings(llama):
  spec, OffloadSpec = llama.offload.offload_spec, llama.offload.OffloadSpec
  assert spec("none") == OffloadSpec("none") and spec("all").kind == "all"
  assert spec("slowdown=5%") == spec("slowdown=0.05") == OffloadSpec("slowdown", 0.05)
  assert spec("memory=4GiB") == OffloadSpec("memory", 4 * 2**30)
  assert spec("memory=512MiB").value == 2**29 and spec("memory=2e9").value == 2e9
  assert spec("memory=1.5GB").value == 1.5e9 and str(spec("slowdown=5%")) == "slowdown=5.0%"


def test_llama_resume_refuses_another_vocabulary(llama, capsys, tmp_path):
  """The checkpoint records its vocabulary's digest; --resume compares it with this run's
  (the same flags may mean another tokenizer: another text, e.g. another Python's library).
  Checkpoints from before the record held the fables' characters."""
  cache = tmp_path / "cache"
  run = ["--preset", "tiny", "--resume", "--steps", "40", "--vocab", "300", "--cache",
         str(cache)]

  def save(out: pathlib.Path, args: Any, record: dict[str, Any] | None) -> None:
    meta = {"config": llama.checkpoints.run_config(args, llama.presets.resolve(args))}
    checkpoints_lib.Checkpoints(out / "checkpoints").save(
        30, *_state(1.0), meta if record is None else {**meta, "vocabulary": record})

  args = llama.cli.parse([*run, "--out", str(tmp_path / "same")])
  data = llama.data
  ours = data.vocabulary_record(*data.load_vocabulary(llama.presets.resolve(args), cache))
  save(tmp_path / "same", args, ours)
  llama.cli.parse([*run, "--out", str(tmp_path / "same")])  # the same tokenizer: resumes

  other_text = vocabulary.Text.of("other text", [vocabulary.FABLES.read_text()[::-1]])
  other = data.vocabulary_record(other_text, vocabulary.subwords(other_text, 300, cache))
  assert other["digest"] != ours["digest"]
  save(tmp_path / "other", args, other)
  with pytest.raises(SystemExit):
    llama.cli.parse([*run, "--out", str(tmp_path / "other")])
  err = capsys.readouterr().err
  assert (f"was trained with byte-level BPE of 300 tokens (digest {other['digest'][:12]}) of "
          f"the other text; this run's vocabulary is byte-level BPE of 300 tokens (digest "
          f"{ours['digest'][:12]}) of the fables") in err
  assert "or start a new run with another --out" in err

  chars = ["--preset", "tiny", "--resume", "--steps", "40", "--out", str(tmp_path / "old")]
  save(tmp_path / "old", llama.cli.parse(chars), None)  # from before vocabularies were saved
  llama.cli.parse(chars)  # the fables' characters: resumes


def test_subword_vocabulary_round_trips_and_is_trained_once(monkeypatch, tmp_path):
  documents = [vocabulary.FABLES.read_text()[:20_000],
               "def f(x):\n\treturn x ** 2  # naïve — 東京 ✓\n"]
  text = vocabulary.Text.of("test", documents)
  bpe = vocabulary.subwords(text, 400, tmp_path)
  assert bpe.trained and bpe.size == 400 and list(tmp_path.glob("bpe-400-*.json")) == [bpe.path]
  for document in documents:
    assert bpe.decode(bpe.encode([document])) == document
  ids = vocabulary.encoded(bpe, text, tmp_path)
  assert list(ids).count(bpe.end_of_text) == 1  # between the two documents
  assert bpe.decode(ids) == vocabulary.END_OF_TEXT.join(documents)
  assert len(ids) < text.characters / 2  # subwords: fewer tokens than characters
  # Cached: the same tokenizer read back, not trained again; the ids read, not encoded.
  again = vocabulary.subwords(text, 400, tmp_path)
  assert not again.trained and again.digest == bpe.digest
  monkeypatch.setattr(vocabulary.Subwords, "encode", lambda *_: pytest.fail("encoded again"))
  assert np.array_equal(vocabulary.encoded(again, text, tmp_path), ids)
  assert len(list(tmp_path.iterdir())) == 2  # the tokenizer and the ids, no temporaries
  # Another size or another text: another tokenizer.
  monkeypatch.undo()
  assert vocabulary.subwords(text, 300, tmp_path).digest != bpe.digest
  other = vocabulary.Text.of("test", documents[::-1])
  assert other.digest != text.digest
  assert vocabulary.subwords(other, 400, tmp_path).path != bpe.path
  with pytest.raises(ValueError, match="pass a size above 257"):
    vocabulary.subwords(text, 257, tmp_path)


def test_python_stdlib_text_is_the_standard_librarys_sources():
  text = vocabulary.python_stdlib()
  assert len(text.documents) > 300 and text.characters > 5_000_000
  assert any("class OrderedDict" in d for d in text.documents)  # collections/__init__.py
  assert vocabulary.python_stdlib().digest == text.digest  # the same text, the same digest


def test_examples_share_one_progress_bar(monkeypatch, capsys):
  for script in (EXAMPLES / "train_gpt.py", EXAMPLES / "llama" / "train.py"):
    source = script.read_text()
    assert "progress_bar(" in source and "class tqdm" not in source, script
    assert "def progress(" not in source, script
  import tqdm

  bar = progress.progress_bar(range(3, 6), total=5)  # a resumed run: steps 1 and 2 were done
  assert isinstance(bar, tqdm.tqdm) and bar.n == 2
  for step in bar:  # the count moves with the steps, not only when the bar redraws
    assert bar.n == step
  bar.close()
  monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed: log lines only
  bar = progress.progress_bar(range(3, 6), total=5)
  assert isinstance(bar, progress.LogLines) and list(bar) == [3, 4, 5]
  bar.set_postfix(loss="1.0")
  bar.write("step 5: loss 1.0")
  assert capsys.readouterr().out == "step 5: loss 1.0\n"


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
