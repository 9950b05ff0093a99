"""The examples train: train_gpt and llama/train (tiny presets) train, checkpoint, resume
bitwise and match a whole-step jax.jit; LoRA fine-tunes a trained run; fsdp_train,
pipeline_1f1b and linen_mlp train, and end a Ctrl-C in one line that says how to rerun them.
The Llama tiny preset computes the golden numbers recorded from an earlier version and
resumes a checkpoint it wrote (tests/llama_golden.py)."""

from __future__ import annotations

import importlib
import json
import pathlib
import re
import shlex
import shutil
from typing import Any

import jax
import numpy as np
import pytest

import llama_golden
from examples import checkpoints as checkpoints_lib
from examples_support import (checkpoint_state, continue_run, final_params, flip_bytes,
                              interrupted, run_example, unoptimized)
from examples_support import env, llama  # noqa: F401 (pytest fixtures)


def test_train_gpt_trains_checkpoints_and_resumes_bitwise(tmp_path, env):
  """On the CPU every run compiles `unoptimized`: the runs are compared with each other
  (--check's whole step, the resumed run), all compiled with the same flags."""
  env = unoptimized(env)
  common = ["--preset", "tiny", "--steps", "12", "--sample", "0"]
  whole, parts = tmp_path / "whole", tmp_path / "parts"
  out = run_example("examples.train_gpt", env, *common, "--out", str(whole), "--check")
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
  line = interrupted("examples.train_gpt", env, "generation", *common[:-1], "4", "--out",
                     str(parts), "--stop-after", "5")
  assert line.startswith(f"interrupted (Ctrl-C) during generation: checkpoint step 5 kept "
                         f"({parts.absolute() / 'checkpoints' / '5'}); continue with: python ")
  assert len(json.loads((parts / "metrics.json").read_text())["losses"]) == 5
  out = continue_run(line.replace("--sample 4", "--sample 0"), env)
  assert "resumed from step 5" in out
  resumed = json.loads((parts / "metrics.json").read_text())
  assert resumed["losses"] == losses  # floats written from float32: equal means bitwise
  assert resumed["params_sha256"] == metrics["params_sha256"]


def test_llama_trains_matches_whole_step_resumes_bitwise_and_decodes(tmp_path, env):
  """On the CPU every run compiles `unoptimized`: the runs are compared with each other
  (--check's whole step, the resumed run, --whole-step), all compiled with the same flags."""
  # Without excess precision XLA rounds every bf16 value where the program says, also inside
  # one whole-step executable: then the first step is bitwise that of the whole-step jit.
  env = unoptimized({**env, "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} "
                                         "--xla_allow_excess_precision=false"})
  common = ["--preset", "tiny", "--steps", "12", "--generate", "8", "--no-flat",
            "--residuals", "all"]  # the defaults are flat and recompute: the other test
  whole, parts = tmp_path / "whole", tmp_path / "parts"
  out = run_example("examples.llama.train", env, *common, "--out", str(whole), "--check",
                    "--rounds", "3", "--round-steps", "2")
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

  out = run_example("examples.llama.train", env, *common, "--out", str(parts), "--stop-after", "5")
  assert "stopped after step 5 of 12 (--stop-after); continue with: python " in out
  # Killed after the checkpoint, before metrics.json: the history is in the checkpoint.
  (parts / "metrics.json").unlink()
  out = continue_run(out.replace("--generate 8", "--generate 0"), env)  # decoded above
  assert "resumed from step 5" in out
  resumed = json.loads((parts / "metrics.json").read_text())
  assert resumed["losses"] == losses and resumed["eval_losses"] == eval_losses
  assert resumed["params_sha256"] == metrics["params_sha256"]

  # --whole-step: the same loop through one jax.jit, the same keys (first step bitwise as
  # --check found), timed the same way. The same flags as --check's: its whole step, the
  # same program, comes from the compilation cache.
  step = tmp_path / "step"
  out = run_example("examples.llama.train", env, *common, "--generate", "0", "--whole-step",
                    "--out", str(step))
  assert "--whole-step: training through one whole-step jax.jit" in out
  assert "train Block" not in out  # no graphed training layers captured
  trained = json.loads((step / "metrics.json").read_text())
  assert trained["mode"] == "whole_step" and len(trained["throughput"]["loop"]["rounds"]) == 3
  if jax.default_backend() == "cpu":
    assert trained["losses"][0] == losses[0]
  assert max(abs(a - b) for a, b in zip(trained["losses"], losses)) < 1e-2


def test_llama_flat_params_train_match_whole_step_and_resume_bitwise(tmp_path, env):
  """On the CPU every run compiles `unoptimized`: the runs are compared with each other
  (--check's whole step, the resumed, pipelined, offloaded and fused runs), all compiled with
  the same flags."""
  env = unoptimized({**env, "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} "
                                         "--xla_allow_excess_precision=false"})
  # Flat and recompute: the defaults. No generation: the runs are compared by their
  # training (flat params generate in the --fsdp runs, tests/test_examples_fsdp.py, and in
  # test_llama_lora_fine_tunes_a_trained_run).
  common = ["--preset", "tiny", "--steps", "12", "--generate", "0"]
  whole, parts = tmp_path / "whole", tmp_path / "parts"
  out = run_example("examples.llama.train", env, *common, "--out", str(whole), "--check")
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
  # Resumed by 2 pipeline stages (zero-bubble: split backwards, deferred weight gradients):
  # a one-device checkpoint, the same steps bit for bit.
  shutil.copytree(whole, parts)
  flip_bytes(parts / "checkpoints" / "12")
  pipeline = (["--pipeline", "2", "--schedule", "zero-bubble"]
              if jax.default_backend() == "cpu" else [])  # 8 virtual CPU devices
  out = run_example("examples.llama.train", env, *common, "--out", str(parts), "--resume",
                    *pipeline)
  assert "checkpoint step 12 in" in out and "does not match its digests" in out
  assert "resumed from step 10" in out
  assert not pipeline or "--pipeline 2 --schedule zero-bubble: 2 chunks of [2, 2] parts" in out
  assert (parts / "checkpoints-rejected" / "12").is_dir()
  resumed = json.loads((parts / "metrics.json").read_text())
  assert resumed["losses"] == losses and resumed["eval_losses"] == metrics["eval_losses"]
  assert resumed["params_sha256"] == metrics["params_sha256"]

  # By 2 stages from step 1, zero-bubble with each chunk's layers fused (one forward, one
  # dgrad and one deferred wgrad executable a chunk a microbatch), dispatched from a thread
  # per stage: bitwise the one-device run (tied embeddings: the head's share of the
  # embedding's grads is summed apart, in another order, which matched here). Per stage: its
  # parts, params and residuals; per dispatch thread, its CPU time a step.
  if pipeline:
    piped = tmp_path / "piped"
    out = run_example("examples.llama.train", env, *common, "--out", str(piped), "--pipeline",
                      "2", "--schedule", "zero-bubble", "--fuse", "--pipeline-threads")
    assert "--pipeline 2 --schedule zero-bubble: 2 chunks of [2, 2] parts" in out
    piped_metrics = json.loads((piped / "metrics.json").read_text())
    assert piped_metrics["pipeline"]["threads"] is True
    assert len(piped_metrics["throughput"]["loop"]["thread_seconds_per_step"]) == 2
    # Each chunk's first layer captured its own signature and its chunk's fused segment,
    # each three executables (forward, dgrad, wgrad).
    assert [piped_metrics["stats"][f"train {name}"][count] for name in ("Embed[0]", "Block[2]")
            for count in ("captures", "compiles")] == [2, 6, 2, 6]
    assert piped_metrics["losses"] == losses and piped_metrics["eval_losses"] == metrics[
        "eval_losses"]
    assert piped_metrics["params_sha256"] == metrics["params_sha256"]
    stages = piped_metrics["pipeline"]["per_stage"]
    assert [stage["parts"] for stage in stages] == [["Embed[0]", "Block[1]"],
                                                     ["Block[2]", "Head[3]"]]
    assert sum(stage["params"] for stage in stages) == piped_metrics["params"]
    assert len({stage["device"] for stage in stages}) == 2
    assert all(stage["residual_bytes"] > 0 for stage in stages)

  # --offload memory=0: every kept buffer of every block waits in pinned host memory between
  # its forward and backward (the plan for a budget of 0 bytes): the same run, bit for bit.
  offloaded = tmp_path / "offloaded"
  out = run_example("examples.llama.train", env, *common, "--out", str(offloaded), "--offload",
                    "memory=0", "--no-check")
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
  run_example("examples.llama.train", env, *common, "--out", str(fused), "--fuse", "--no-check")
  fused_metrics = json.loads((fused / "metrics.json").read_text())
  assert fused_metrics["config"]["fuse"] is True
  if jax.default_backend() == "cpu":
    assert fused_metrics["losses"] == losses
    assert fused_metrics["params_sha256"] == metrics["params_sha256"]


def test_llama_plain_ends_untied_without_dropout_subwords_offloaded(tmp_path, env):
  """Also a byte-level BPE vocabulary (trained on the fables into --cache, recorded in the
  checkpoint) and --offload of the blocks in a make_graphed call of their own. On the CPU
  compiled `unoptimized`: the run is checked by what it prints and writes, its loss only
  falling."""
  out = run_example("examples.llama.train", unoptimized(env), "--preset", "tiny", "--steps",
                    "4", "--generate", "4", "--plain-ends", "--untied", "--dropout", "0",
                    "--microbatches", "1", "--vocab", "300", "--cache", str(tmp_path / "cache"),
                    "--offload", "all", "--out", str(tmp_path))
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


# The tiny preset as a user runs it, once for the tests of this group (one xdist worker): the
# golden numbers' run and the LoRA test's base run.
TINY_GROUP = pytest.mark.xdist_group("llama-tiny")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> pathlib.Path:
  """The --out of `--preset tiny` with nothing else given (12 steps, then generation, where
  this machine has golden numbers to check its text; else `--generate 0`): read only (a test
  that changes it copies it first)."""
  out = tmp_path_factory.mktemp("tiny") / "run"
  golden = isinstance(llama_golden.expected(), dict)
  run_example("examples.llama.train", env, "--preset", "tiny", "--out", str(out),
              *([] if golden else ["--generate", "0"]))
  return out


@TINY_GROUP
def test_llama_lora_fine_tunes_a_trained_run(llama, tmp_path, env, tiny_run):
  """A tiny run, then `--lora 4 --init-from` it into an --out of its own: the base params
  (the run's last checkpoint) stay bitwise what they were, in the checkpoint and by digest
  before and after; the adapters train (Optax over them only) and the held-out loss drops
  from the loaded model's; a LoRA run resumed from its step-10 checkpoint ends bit for bit
  as the uninterrupted one. A LoRA run is an --init-from too (its adapters merged): for LoRA
  on LoRA, and for fine-tuning every param."""
  base, tuned, resumed = tmp_path / "base", tmp_path / "lora", tmp_path / "resumed"
  tiny = ["--preset", "tiny", "--generate", "0"]
  shutil.copytree(tiny_run, base)  # a tiny run (moved away below)
  lora = [*tiny, "--init-from", str(base), "--lora", "4"]
  out = run_example("examples.llama.train", env, *lora, "--out", str(tuned))
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
  params, base_params = final_params(tuned, 12), final_params(base, 12)
  for path, value in base_params.items():
    assert np.array_equal(params[path], value), path
  adapters = [path for path in params if "lora" in path]
  assert adapters == ["[1]['lora.float32']", "[2]['lora.float32']"]
  assert all(np.any(params[path] != 0) for path in adapters)

  # A LoRA run is a run to start from: its adapters merged into its kernels (W + A @ B), then
  # new adapters over them (LoRA on LoRA), ...
  stacked = tmp_path / "lora-on-lora"
  out = run_example("examples.llama.train", env, *tiny, "--init-from", str(tuned), "--lora", "4",
                    "--steps", "2", "--generate", "4", "--out", str(stacked))
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
  out = run_example("examples.llama.train", env, *lora, "--out", str(resumed), "--resume")
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
  checkpoints_lib.Checkpoints(run / "checkpoints").save(12, *checkpoint_state(1.0),
                                                       {**meta, "losses": [1.0] * 12})
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


@TINY_GROUP
def test_llama_tiny_preset_computes_the_golden_numbers(tiny_run):
  """`--preset tiny` as a user runs it: bit for bit the losses, held-out losses, params and
  generated text the example computed before it became a package of modules (ac11c78;
  tests/data/llama/golden.json says how they were recorded)."""
  golden = _golden()
  metrics = json.loads((tiny_run / "metrics.json").read_text())
  assert metrics["losses"] == golden["losses"]  # floats from float32: equal means bitwise
  assert metrics["eval_losses"] == golden["eval_losses"]
  assert metrics["params_sha256"] == golden["params_sha256"]
  assert metrics["generation"]["continuation"] == golden["continuation"]


@pytest.mark.cpu_only
def test_llama_resumes_a_checkpoint_written_before_the_split_through_ctrl_c(llama, capsys, tmp_path,
                                                                           env):
  """The step-10 checkpoint of that golden run, as the example at ac11c78 wrote it, resumes
  with --legacy-metadata (its layout, config, vocabulary and array digests are this
  version's; its metadata has no digest, and is refused without the flag). The resumed run
  gets Ctrl-C inside the capture's first compile, in step 12's evaluation (steps 11 and 12
  trained, not saved) and in its save: each time one line, status 130, and the command it
  names goes on; the last one finds the run finished and writes the missing metrics.json
  from its checkpoint. Where the golden numbers were recorded, the losses are bit for bit
  the golden run's. The runs are on the CPU on any machine (`cpu_only`): what Ctrl-C does is
  the example's (examples/interrupt.py), not the device's, and the golden numbers are the
  CPU's."""
  env = {**env, "JAX_PLATFORMS": "cpu"}
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
    line = interrupted("examples.llama.train", env, at, *command)
    assert line.startswith(f"interrupted (Ctrl-C) during {where}: {kept}; continue with: "
                           "python "), line
    assert line.endswith(shlex.join(command[:-2] + ["--legacy-metadata", "--resume"]))
  line = interrupted("examples.llama.train", env, "save@12", *command)  # held until it is written
  assert line.startswith("interrupted (Ctrl-C) during a checkpoint save (step 12): every step "
                         f"is trained, checkpoint step 12 kept ({tmp_path / 'checkpoints' / '12'})"
                         "; nothing is left to train"), line
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["10", "12"]
  assert not (tmp_path / "metrics.json").exists()  # the Ctrl-C came before it
  out = run_example("examples.llama.train", env, *command)
  assert f"{tmp_path / 'metrics.json'} was missing: written again from step 12's" in out
  metrics = json.loads((tmp_path / "metrics.json").read_text())
  assert metrics["losses"][:10] == saved["losses"] and len(metrics["losses"]) == 12
  golden = llama_golden.expected()
  if not isinstance(golden, str):  # else steps 11 and 12 ran on another machine's numerics
    assert metrics["losses"] == golden["losses"]
    assert metrics["eval_losses"] == golden["eval_losses"]


# ------------------------------------------- the examples that save nothing, and their Ctrl-C

NOTHING_KEPT = "this example saves no checkpoints, so nothing is kept"


def _ctrl_c(module: str, env: dict[str, str], args: list[str], *at: tuple[str, str]) -> list[str]:
  """Ctrl-C (SIGINT) at each (point, its line's "during ...: kept") of `at` in `python -m
  module args` (one run each), an example that saves nothing: one line that names the
  command as given. Returns that command's args, to run it again."""
  for point, where_kept in at:
    line = interrupted(module, env, point, *args)
    assert line == (f"interrupted (Ctrl-C) during {where_kept}; run it again with: "
                    f"{shlex.join(['python', '-m', module, *args])}"), line
  python, m, again, *rest = shlex.split(line.split("run it again with: ")[1])
  assert [python, m, again] == ["python", "-m", module]
  return rest


@pytest.mark.cpu_only
def test_fsdp_example_trains_with_sharded_weights_and_ctrl_c_ends_it_in_one_line(env):
  env = {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  args = _ctrl_c("examples.fsdp_train", env, ["--steps", "3", "--layers", "2"],
                 ("capture", f"capture: {NOTHING_KEPT}"),
                 ("training@1", f"training (step 1): {NOTHING_KEPT}"))
  out = run_example("examples.fsdp_train", env, *args)
  assert "8 x cpu: captured 2 layers" in out and "captures [1, 0]" in out
  assert "param shardings kept through training: True" in out
  assert "forward {'all-gather': 2}" in out
  losses = [float(line.split("loss ")[1]) for line in out.splitlines()
            if line.startswith("step")]
  assert len(losses) == 2 and losses[-1] < losses[0]


@pytest.mark.cpu_only
def test_pipeline_example_trains_over_two_devices_like_one_and_ctrl_c_ends_it_in_one_line(env):
  env = {**env, "JAX_PLATFORMS": "cpu",  # its own 2 CPU devices, whatever ours are
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  args = _ctrl_c("examples.pipeline_1f1b", env, ["--zero-bubble", "--compare", "--steps", "2"],
                 ("capture", f"capture: {NOTHING_KEPT}"),
                 ("compare@1", "--compare's training on one device (step 1): it finished the 2 "
                               "training steps over 2 devices (printed above) and saves no "
                               "checkpoints"))
  out = run_example("examples.pipeline_1f1b", env, *args)
  assert "weights bitwise equal to one device: True" in out
  assert "captures per layer: [1, 0, 1, 0] compiles: 6" in out
  losses = [float(line.split("mean loss ")[1]) for line in out.splitlines()
            if "mean loss" in line]
  assert len(losses) == 4 and losses[1] < losses[0]


LINEN_ARGS = ["--steps", "30"]


@pytest.mark.cpu_only
def test_linen_mlp_ctrl_c_ends_it_in_one_line(env):
  """What Ctrl-C does is the example's, not the device's: its runs are on the CPU."""
  args = _ctrl_c("examples.linen_mlp", {**env, "JAX_PLATFORMS": "cpu"}, LINEN_ARGS,
                 ("capture", f"capture: {NOTHING_KEPT}"),
                 ("training@2", f"training (step 2): {NOTHING_KEPT}"))
  assert args == LINEN_ARGS


def test_linen_mlp_trains(capsys):
  linen_mlp = importlib.import_module("examples.linen_mlp")
  result = linen_mlp.main(LINEN_ARGS)  # in this process: no jax start-up
  assert result["losses"][-1] < result["losses"][0]
  assert "cache hits 1" in capsys.readouterr().out  # the blocks share one capture
