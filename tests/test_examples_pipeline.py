"""The Llama example by pipeline stages (--pipeline): bitwise the one-device graphed run, and
its checkpoints interchangeable with one-device runs'."""

from __future__ import annotations

import json
import re
import shlex

import jax
import pytest

from examples_support import run_example
from examples_support import env  # noqa: F401 (pytest fixture)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="two stages on two devices")
def test_llama_pipeline_trains_bitwise_as_one_device_and_shares_its_checkpoints(tmp_path, env):
  # 4 microbatches through 2 stages (a 1F1B steady state), untied: the head's grads are its
  # own, so each part's grads are summed in microbatch order as on one device (tied, the
  # head's share of the embedding's grads is summed apart: another order of float sums).
  common = ["--preset", "tiny", "--steps", "4", "--generate", "0", "--untied",
            "--microbatches", "4"]
  # Steps 1-2 on one device, saved; resumed by 2 stages (1F1B) for steps 3-4.
  handed, zero_bubble = tmp_path / "handed", tmp_path / "zero_bubble"
  out = run_example("examples.llama.train", env, "--out", str(handed), "--stop-after", "2",
                    *common)
  python, m, module, *args = shlex.split(re.search(r"continue with: (.*)", out).group(1))
  assert "--resume" in args
  out = run_example(module, env, *args, "--pipeline", "2")
  assert "resumed from step 2" in out
  assert "--pipeline 2 --schedule 1f1b: 2 chunks of [2, 2] parts" in out
  resumed = json.loads((handed / "metrics.json").read_text())

  # All 4 steps on 2 stages, zero-bubble (split backwards, deferred weight gradients).
  run_example("examples.llama.train", env, "--out", str(zero_bubble), "--pipeline", "2",
              "--schedule", "zero-bubble", *common)
  piped = json.loads((zero_bubble / "metrics.json").read_text())
  # Steps 1-2: the pipeline's are the one-device run's; steps 3-4: 1F1B's are zero-bubble's.
  assert piped["losses"] == resumed["losses"] and len(piped["losses"]) == 4
  assert piped["eval_losses"] == resumed["eval_losses"]
  assert piped["params_sha256"] == resumed["params_sha256"]
  stages = piped["pipeline"]["per_stage"]
  assert [stage["parts"] for stage in stages] == [["Embed[0]", "Block[1]"],
                                                   ["Block[2]", "Head[3]"]]
  assert sum(stage["params"] for stage in stages) == piped["params"]
  assert len({stage["device"] for stage in stages}) == 2
  assert all(stage["residual_bytes"] > 0 for stage in stages)
