"""The examples' checkpoints: the history lives in the checkpoint, a corrupt step is named
and skipped, the newest are kept; metrics.json is written atomically; flags and --resume
(step, config, metadata, vocabulary, a model of other shapes) are checked before anything
runs."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from examples import checkpoint_checks, records, vocabulary
from examples import checkpoints as checkpoints_lib
from examples_support import ROOT, checkpoint_state, data_files, flip_bytes
from examples_support import llama  # noqa: F401 (pytest fixtures)


# ---------------------------------------------------------------------- checkpoints, flags


def _corrupt(kind: str, step: pathlib.Path) -> None:
  files = data_files(step)
  if kind == "flipped":
    flip_bytes(step)
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
    checkpoints.save(step, *checkpoint_state(float(step)), _meta(step))
  _corrupt(kind, tmp_path / "checkpoints" / "20")
  # The look before anything is built reads the newest step whose metadata is whole.
  latest = checkpoints_lib.Checkpoints(tmp_path / "checkpoints").latest_meta()
  assert latest[0] == (20 if kind in ("flipped", "truncated", "deleted") else 10)
  with pytest.warns(checkpoints_lib.CheckpointWarning,
                    match=r"checkpoint step 20 in .*; resuming from step 10 instead") as found:
    restored = checkpoints_lib.Checkpoints(tmp_path / "checkpoints").restore(*checkpoint_state(0.0))
  (warning,) = found
  assert re.search(DAMAGE[kind], str(warning.message))
  assert "bound method" not in str(warning.message)
  assert restored.step == 10 and len(restored.meta["losses"]) == 10
  assert np.all(np.asarray(restored.params["w"]) == 10.0)
  assert restored.streams[0][1] == 4
  # The rejected step is out of the way: saving step 20 again works.
  checkpoints_lib.Checkpoints(tmp_path / "checkpoints").save(20, *checkpoint_state(20.0), _meta(20))
  assert (tmp_path / "checkpoints-rejected" / "20").is_dir()


def test_a_history_that_does_not_fit_its_step_is_rejected(tmp_path):
  """A loss dropped from a step's metadata: with the metadata's digest, the digest tells;
  in a step saved before metadata digests (none in it), read with --legacy-metadata (else
  refused: `test_corrupt_latest_checkpoint_is_named_and_the_previous_restored`), the count
  of losses does."""
  checkpoints = checkpoints_lib.Checkpoints(tmp_path / "checkpoints", keep=3)
  for step in (10, 20, 30):
    checkpoints.save(step, *checkpoint_state(float(step)), _meta(step))
  for step, keep_digest in ((30, True), (20, False)):
    path = tmp_path / "checkpoints" / str(step) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta["losses"].pop()
    if not keep_digest:
      del meta[checkpoint_checks.META_DIGEST]
    path.write_text(json.dumps(meta))
  with pytest.warns(checkpoints_lib.CheckpointWarning) as found:
    restored = checkpoints_lib.Checkpoints(tmp_path / "checkpoints",
                                  legacy_metadata=True).restore(*checkpoint_state(0.0))
  assert restored.step == 10 and len(restored.meta["losses"]) == 10
  assert [str(w.message).split(";")[0] for w in found] == [
      f"checkpoint step 30 in {tmp_path / 'checkpoints'} has metadata that does not match its "
      "digest (its config, loss history or array digests were changed after the save)",
      f"checkpoint step 20 in {tmp_path / 'checkpoints'} has metadata holding 19 training "
      "losses for its 20 steps"]


def test_the_newest_checkpoints_are_kept_as_asked(tmp_path):
  checkpoints = checkpoints_lib.Checkpoints.for_run(tmp_path, fresh=False, command="", keep=3)
  for step in (10, 20, 30, 40):
    checkpoints.save(step, *checkpoint_state(float(step)), _meta(step))
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [20, 30, 40]
  assert checkpoints.kept() == "the newest 3 steps kept: --keep-checkpoints N keeps more"
  assert checkpoints_lib.Checkpoints(tmp_path / "other").kept().startswith(
      "the newest 2 steps kept")


def test_no_intact_checkpoint_is_one_error(tmp_path):
  checkpoints = checkpoints_lib.Checkpoints(tmp_path / "checkpoints")
  checkpoints.save(10, *checkpoint_state(1.0), _meta(10))
  flip_bytes(tmp_path / "checkpoints" / "10")
  with pytest.raises(checkpoints_lib.NoCheckpoint, match=r"restores intact: step 10 ") as found:
    checkpoints.restore(*checkpoint_state(0.0))
  assert "--fresh" not in str(found.value)  # advice is the caller's: --resume's, below
  with pytest.raises(SystemExit, match=r"^--resume: no checkpoint .* start afresh with --fresh "
                     r"instead of --resume \(they are moved aside, not deleted\)$"):
    checkpoints.resume(*checkpoint_state(0.0))
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
    (["--pipeline", "2", "--fsdp", "2", "--prefetch"],
     r"--pipeline does not combine with --fsdp, --prefetch \(--fsdp shards .*\): drop them"),
    (["--schedule", "zero-bubble"], "--schedule orders a pipeline's stages: it needs --pipeline"),
    (["--pipeline-threads"], "--pipeline-threads dispatches a pipeline's stages from a thread "
                             "each: it needs --pipeline N"),
    (["--pipeline", "2", "--schedule", "interleaved"],
     "splits the 2 blocks into 4 chunks of at least one block each: pass at most 1 stages"),
], ids=["seed", "dropout", "negative_dropout", "generate", "temperature", "rounds",
        "round_steps", "whole_step_check", "whole_step_fuse", "fuse_zero", "fuse_word",
        "cudnn_float32", "batch", "fsdp_zero", "fsdp_batch",
        "fsdp_no_flat", "fsdp_devices", "coordinator_alone", "processes_without_fsdp",
        "process_id", "context", "vocab", "offload_spelling", "offload_unit",
        "offload_slowdown", "offload_whole_step", "offload_fuse", "offload_fsdp",
        "stop_after_past_steps", "keep_checkpoints", "pipeline_fsdp_prefetch",
        "schedule_alone", "pipeline_threads_alone", "pipeline_interleaved_depth"])
def test_llama_flags_are_checked_first(llama, capsys, tmp_path, flags, message):
  with pytest.raises(SystemExit) as exit:
    llama.cli.parse(["--preset", "tiny", "--out", str(tmp_path), *flags])
  assert exit.value.code == 2
  assert re.search(message, capsys.readouterr().err)


def test_llama_pipeline_flags_are_checked_before_fsdp_devices(tmp_path):
  """On one device (a one-GPU machine) too, the flags --pipeline refuses are the message,
  not the devices --fsdp would need (the test above runs on 8 CPU devices, where both pass
  the count)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  done = subprocess.run([sys.executable, "-m", "examples.llama.train", "--preset", "tiny",
                         "--out", str(tmp_path), "--pipeline", "2", "--fsdp", "2",
                         "--prefetch"], env=env, cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 2, done.stderr
  assert re.search(r"--pipeline does not combine with --fsdp, --prefetch", done.stderr), (
      done.stderr)


def test_llama_resume_checks_the_checkpoints_step_and_config(llama, capsys, tmp_path):
  run = ["--preset", "tiny", "--out", str(tmp_path), "--resume"]
  args = llama.cli.parse([*run, "--steps", "40"])  # no checkpoint yet: nothing to compare
  config = llama.checkpoints.run_config(args, llama.presets.resolve(args))
  checkpoints_lib.Checkpoints(tmp_path / "checkpoints").save(30, *checkpoint_state(1.0),
                                                             {"config": config})

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
  checkpoints_lib.Checkpoints(tmp_path / "checkpoints").save(31, *checkpoint_state(1.0),
                                                    {"config": {**sharded, "fsdp": 1}})
  assert ("--fsdp 1 (the checkpoint's run: 1, its flat buffers in the layout before "
          "jg.flat.split's)") in refused(*fsdp_run[len(run):])
  checkpoints_lib.Checkpoints(tmp_path / "checkpoints").save(32, *checkpoint_state(1.0),
                                                             {"config": sharded})
  llama.cli.parse(fsdp_run)  # this layout: the same run


def test_llama_resume_reads_verified_metadata_and_stops_a_finished_run_first(llama, capsys,
                                                                              tmp_path):
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
    checkpoints.save(step, *checkpoint_state(float(step)), {**meta, "losses": [1.25] * step})
  _corrupt("meta_seed_bit", tmp_path / "checkpoints" / "40")
  with pytest.raises(SystemExit):
    llama.cli.parse([*run, "--seed", "1"])
  assert "--seed 1 (the checkpoint's run: 0)" in capsys.readouterr().err
  assert llama.cli.parse(run).seed == 0  # step 30's run: resumes (step 40 rejected then)

  finished = tmp_path / "finished"
  checkpoints_lib.Checkpoints(finished / "checkpoints").save(40, *checkpoint_state(1.0),
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
  flip_bytes(finished / "checkpoints" / "40")
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
        30, *checkpoint_state(1.0), meta if record is None else {**meta, "vocabulary": record})

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
