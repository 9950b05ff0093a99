"""Smoke tests of benchmarks/ and benchmarks/probes/ at tiny sizes on the CPU: each script
runs and reports what it measures (benchmarks/README.md lists them). The scripts run on the
CPU on any machine (`run_script`), so their tests are `cpu_only`: a GPU run leaves them to CI.

No timing thresholds: timings belong in docs/performance.md, not in pass/fail tests.
"""

import importlib
import json
import os
import subprocess
import sys
import time

import jax
import pytest

from jaxgraph import schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# A smoke run checks that a script runs and reports, not its numbers: XLA:CPU compiles
# without LLVM's optimizations (this module: 77 s instead of 107 s, user time 137 s instead
# of 200 s, when measured; numerics may differ).
SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0"


@pytest.fixture
def run_script(compilation_cache_env):
  """Runs `python -m benchmarks.<name>` on the CPU as the README says, from the root, with
  the run's compilation cache (what an earlier script compiled is not compiled again);
  `devices`: that many virtual CPU devices (as conftest.py gives the suite 8)."""
  def run(name, *args, devices=None):
    flags = SMOKE_XLA_FLAGS + ("" if devices is None else
                               f" --xla_force_host_platform_device_count={devices}")
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS=flags,
               **compilation_cache_env)
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return done

  return run


def _module(name):
  """`benchmarks.<name>`, imported as the scripts import each other."""
  return importlib.import_module(f"benchmarks.{name}")


# Every (base, modifier) pair of bench.py's JAX variants, in 11 of its 17 (each variant
# compiles its own executables: the other 6 combine these pairs). README: the same list.
# With the run's compilation cache, `-own`'s per-layer copies are the executable itself on
# the CPU (capture.loaded_copy); tests/test_per_layer_executables.py tests the copies.
SMOKE_VARIANTS = ("jaxgraph", "jaxgraph-keys", "jaxgraph-hooks", "jaxgraph-recompute-nodropout",
                  "jaxgraph-fuse-flat", "jaxgraph-fuse-unpacked", "jaxgraph-raw",
                  "jaxgraph-raw-own", "jit-unrolled", "jit-unrolled-nodropout", "jit-scan")


@pytest.mark.cpu_only
def test_bench_tiny_reports_its_variants(run_script, tmp_path):
  bench = _module("bench")
  assert set(SMOKE_VARIANTS) <= set(bench.JAX_VARIANTS)

  def pairs(names):
    specs = [bench.parse_variant(name) for name in names]
    return {(s.base, m) for s in specs for m in s.modifiers} | {(s.base, None) for s in specs}

  assert pairs(SMOKE_VARIANTS) == pairs(bench.JAX_VARIANTS)
  run = run_script("bench", "--tiny", "--no-probes", "--iters", "1", "--reps", "1",
                   "--out", str(tmp_path), "--variants", *SMOKE_VARIANTS,
                   *bench.TORCH_VARIANTS)
  with open(tmp_path / "bench.json") as f:
    result = json.load(f)
  reported = {r["variant"]: r for r in result["records"]}
  for name in SMOKE_VARIANTS:
    record = reported[name]
    assert record["size"] == "tiny"
    assert record["step"]["median"] > 0 and min(record["step_ms"]) > 0
    assert record["capture_s"] > 0
    assert record["host_us_per_executable"] > 0
  for name in bench.TORCH_VARIANTS:
    assert name in reported or name in result["meta"]["skipped"]
  assert (tmp_path / "bench.png").exists() or "no plot" in run.stdout


@pytest.mark.cpu_only
def test_llama_breakdown_tiny_reports_each_part(run_script, tmp_path):
  """benchmarks/probes/llama_breakdown.py follows the Llama example it measures (it builds
  the example's trainer and whole step): it runs at the tiny preset and reports its parts."""
  run_script("probes.llama_breakdown", "--preset", "tiny", "--rounds", "1", "--steps", "1",
             "--variants", "recompute", "--out", str(tmp_path))
  with open(tmp_path / "breakdown.json") as f:
    found = json.load(f)["variants"]["recompute"]
  assert found["call"]["arrays_per_vjp"] >= 2 and found["call"]["vjp_host_us"] > 0
  assert found["step"]["graphed_tok_s"] > 0 and found["step"]["whole_tok_s"] > 0


@pytest.mark.cpu_only
def test_llama_offload_tiny_reports_each_variant(run_script, tmp_path):
  """benchmarks/llama_offload.py builds the Llama example's step with its --offload, one
  process per variant, and reports tokens/s, the bytes moved and the plan (no device memory
  statistics on the CPU)."""
  run = run_script("llama_offload", "--preset", "tiny", "--variants", "none", "all",
                   "--warmup", "1", "--rounds", "1", "--round-steps", "1", "--out",
                   str(tmp_path))
  with open(tmp_path / "llama_offload.json") as f:
    found = json.load(f)
  none, everything = found["variants"]["none"], found["variants"]["all"]
  assert none["tok_s"] > 0 and none["offload_bytes"] == 0 and none["offload"] is None
  assert everything["offload_bytes"] == everything["residual_bytes"] > 0
  assert everything["offload"]["flags"] == [True, True]
  assert [row["variant"] for row in found["table"]] == ["none", "all"]
  assert "block       fwd ms" in run.stdout  # the plan's per-block measurement


@pytest.mark.cpu_only
def test_llama_lora_tiny_compares_lora_with_full_fine_tuning(run_script, tmp_path):
  """benchmarks/llama_lora.py trains a base run, then fine-tunes it in full and with LoRA, one
  process each, and reports both runs' tokens/s and what each trained."""
  run = run_script("llama_lora", "--preset", "tiny", "--base-steps", "10", "--steps", "9",
                   "--repeats", "1", "--rank", "4", "--out", str(tmp_path))
  with open(tmp_path / "llama_lora.json") as f:
    found = json.load(f)
  full, lora = found["runs"]
  assert (full["variant"], lora["variant"]) == ("full", "lora")
  assert full["tok_s"] > 0 and lora["tok_s"] > 0
  assert lora["trained_params"] < full["trained_params"] == full["params"]
  assert lora["base_unchanged"] is True and full["base_unchanged"] is None
  assert "--lora 4" in lora["command"] and "--init-from" in full["command"]
  rows = {row["variant"]: row for row in found["table"]}
  assert rows["lora"]["vs_full"] == round(lora["tok_s"] / full["tok_s"], 3)
  assert "vs full" in run.stdout


@pytest.mark.cpu_only
def test_llama_pipeline_tiny_records_its_rows(run_script, tmp_path):
  """benchmarks/llama_pipeline.py trains the example on one device, with --fsdp 2 and by
  stages (2 virtual devices; --fuse: every run's layers fused, each chunk's in the pipeline;
  --threads: a dispatch thread per stage) and records each schedule's tokens/s against its
  bubble's bound (simulated from the order the run recorded), FSDP's tokens/s and the host
  time a step, each dispatch thread's too."""
  record = tmp_path / "pipeline.txt"
  run = run_script("llama_pipeline", "--preset", "tiny", "--stages", "2", "--microbatches", "2",
                   "--round-steps", "1", "--schedules", "1f1b", "--fuse", "--threads", "--cache",
                   str(tmp_path / "cache"), "--out", str(tmp_path), "--record", str(record),
                   devices=2)
  found = json.loads((tmp_path / "llama_pipeline.json").read_text())
  (row,) = found["rows"]
  base, fsdp = found["one_device"], found["fsdp"]
  metrics = json.loads((tmp_path / "1f1b" / "metrics.json").read_text())
  assert metrics["config"]["fuse"] is True and row["fuse"] is True
  assert all("--fuse" in run["command"] for run in (row, base, fsdp))
  assert "--pipeline-threads" in row["command"] and "--pipeline-threads" not in base["command"]
  bubble = schedule.bubble_fraction(metrics["pipeline"]["order"], stages=2)
  bound = 2 * base["tokens_per_second"] * (1 - bubble)
  # the ratio of the unrounded tokens/s (the run's metrics), not of the row's rounded one
  tok_s = metrics["tokens_per_second"]
  assert row["tok_s"] == round(tok_s)
  assert row["bound"] == round(bound) and row["ratio"] == round(tok_s / bound, 3)
  assert "--fsdp 2" in fsdp["command"] and row["fsdp_tok_s"] == round(fsdp["tokens_per_second"])
  loop = metrics["throughput"]["loop"]
  assert 0 < loop["host_seconds_per_step"] and 0 < loop["step_seconds"]
  assert row["host_step"] == round(loop["host_seconds_per_step"] / loop["step_seconds"], 3)
  assert [s["stage"] for s in row["per_stage"]] == [0, 1]
  lines = record.read_text().splitlines()
  assert [line.split()[0] for line in lines] == [
      "commit", "device", "jax", "xla_flags", "date", "command", "row"]
  assert f"schedule=1f1b fuse=True threads=True microbatches=2 tok_s={row['tok_s']}" in lines[-1]
  threads = loop["thread_seconds_per_step"]
  assert len(threads) == 2 and row["thread_ms"] == "/".join(str(round(1e3 * t, 2))
                                                            for t in threads)
  assert lines[-1].endswith(f" thread_ms={row['thread_ms']}")
  assert f"fsdp_tok_s={row['fsdp_tok_s']} " in lines[-1]
  assert all(f"{name}: " in run.stdout for name in ("one-device", "fsdp-2", "1f1b"))


@pytest.mark.skipif(jax.device_count() < 4, reason="the example's plan puts each of 4 stages "
                    "on a device of its own (the CPU run has 8 virtual ones)")
def test_bubble_fraction_of_1f1b_is_the_textbook_one():
  """The simulated bubble of the example's merged 1F1B order is (N - 1) / (M + N - 1); the
  interleaved order's smaller; zero-bubble's (N - 1) / (3M + N - 1)."""
  from examples.llama.pipeline import plan

  for stages, microbatches in [(2, 2), (2, 8), (4, 4), (4, 16)]:
    bubble = lambda name: schedule.bubble_fraction(  # noqa: E731
        plan(stages, name, 8, microbatches).order, stages=stages)
    textbook = (stages - 1) / (microbatches + stages - 1)
    assert abs(bubble("1f1b") - textbook) < 1e-12
    assert bubble("interleaved") < textbook
    assert abs(bubble("zero-bubble") - (stages - 1) / (3 * microbatches + stages - 1)) < 1e-12


@pytest.mark.cpu_only
def test_fusion_probe_tiny_reports_each_variant(run_script, tmp_path):
  """benchmarks/probes/fusion_probe.py builds per-layer, fused and diagnostic variants of GPT
  and the Llama example, and reports their timings, host costs and executables (no GPU
  trace on the CPU)."""
  run = run_script("probes.fusion_probe", "--tiny", "--out", str(tmp_path))
  assert "FAILED" not in run.stdout, run.stdout[-4000:]
  with open(tmp_path / "fusion_probe.json") as f:
    records = {(r["model"], r["variant"]): r for r in json.load(f)["records"]}
  assert set(records) == {
      ("tiny", "jaxgraph-recompute"), ("tiny", "jaxgraph-fuse-recompute"),
      ("tiny", "jaxgraph-fuse-recompute+chainremat"), ("llama-tiny", "llama-recompute"),
      ("llama-tiny", "llama-recompute-fuse"), ("llama-tiny", "llama-recompute-fuse+chainremat")}
  for (model, variant), r in records.items():
    assert r["step_ms"]["median"] > 0 and r["capture_s"] > 0
    assert r["host"]["calls"] == (1 if r["fused"] else 2)
    assert r["executables"]["forward_hlo"]["fusion"] > 0
    assert "error" not in r["device"]
    assert r["fused"] == ("vs_per_layer" in r)


@pytest.mark.cpu_only
def test_profile_replay_tiny_traces_and_profiles_jaxgraph(run_script, tmp_path):
  """benchmarks/probes/profile_replay.py traces a bench.py variant (the host's events on the
  CPU) and profiles jaxgraph's host side."""
  run_script("probes.profile_replay", "--size", "tiny", "--steps", "1", "--variants",
             "jaxgraph", "--out", str(tmp_path))
  with open(tmp_path / "profile.json") as f:
    [result] = json.load(f)["results"]
  assert result["variant"] == "jaxgraph" and result["traced_step_ms"] > 0
  assert result["host_events_us_per_step"]
  assert "function calls" in (tmp_path / "host_profile.txt").read_text()


@pytest.mark.cpu_only
def test_native_breakdown_charges_each_sample_to_its_innermost_part(run_script, tmp_path):
  """benchmarks/probes/native_breakdown.py on collapsed stacks written here: a specific part
  anywhere on the stack wins over the generic ones, which go innermost first."""
  stacks = tmp_path / "native_jaxgraph.txt"
  stacks.write_text("main;jaxgraph/_chain.py:run;Compiled.__call__;xla::Execute;cuGraphLaunch 6\n"
                    "main;jaxgraph/_chain.py:run;Compiled.__call__;xla::Execute 2\n"
                    "main;jaxgraph/_graphed.py:vjp 1\n"
                    "main;loop 1\n")
  (tmp_path / "native_jaxgraph.json").write_text(json.dumps(dict(seconds=0.01, calls=10)))
  run = run_script("probes.native_breakdown", str(stacks))
  shares = {line[:42].strip(): line[42:].split() for line in run.stdout.splitlines()[1:]
            if "%" in line}
  assert shares["launch (cuGraphLaunch, kernel launch)"] == ["60.0%", "600.0"]
  assert shares["rest of the runtime's execute path"] == ["20.0%", "200.0"]
  assert shares["jaxgraph Python"] == ["10.0%", "100.0"]
  assert shares["benchmark loop, other Python"] == ["10.0%", "100.0"]
  assert shares["all (wall time / executable calls)"] == ["100.0%", "1000.0"]


def test_native_breakdown_splits_a_multi_device_call_and_counts_the_timed_calls_only(tmp_path):
  """The parts of an executable over several devices: the main thread's wait for the other
  devices' launches, NCCL's set-up, the per-device launch, freeing arrays; and only the
  samples under `profiling._sampled` count where a profile has them (not py-spy's start)."""
  breakdown = _module("probes.native_breakdown").breakdown
  run = "main;sample_native;_sampled (benchmarks/profiling.py:140);step;PjitFunction::Call;"
  stacks = tmp_path / "native.txt"
  stacks.write_text(
      f"{run}xla::Execute;xla::LaunchOnDevice;absl::BlockingCounter::Wait;futex_wait 5\n"
      f"{run}xla::Execute;xla::AcquireCollectiveCliques;xla::Rendezvous;pthread_cond_signal 3\n"
      f"{run}xla::Execute;xla::LaunchOnDevice;tsl::thread::ThreadPool::Schedule 2\n"
      f"{run}PyArray_tp_dealloc;xla::PjRtStreamExecutorBuffer::Delete 1\n"
      "main;sample_native;time_sleep;clock_nanosleep 7\n")
  counts, total = breakdown(str(stacks))
  assert total == 11
  assert counts == {"wait (other devices' launches, events)": 5,
                    "collectives: cliques, rendezvous, NCCL": 3,
                    "launch per device (PjRt, thread pool)": 2,
                    "arrays: destroy (last step's buffers)": 1}


@pytest.mark.cpu_only
def test_host_per_call_reports_the_tree_it_measured(run_script):
  """benchmarks/probes/host_per_call.py times this tree's jaxgraph (the path it names), with
  jaxgraph's default on the CPU: the layers replay one executable, no copies."""
  run = run_script("probes.host_per_call", "--layers", "2", "--rounds", "2", "--steps", "2")
  result = json.loads(run.stdout.splitlines()[-1])
  assert os.path.realpath(result["jaxgraph"]) == os.path.realpath(
      os.path.join(ROOT, "jaxgraph", "__init__.py"))
  assert result["us_per_call"] > 0 and result["backend"] == "cpu"
  assert result["per_layer_executables"] is False and result["per_layer_copies"] == 1


@pytest.mark.cpu_only
def test_host_per_call_times_fsdp_over_devices_against_the_bare_executables(run_script):
  """--devices 2: flat params sharded over 2 devices, the same executables called bare, and
  jaxgraph's Python alone; every time is reported. With a loaded copy per layer, the GPU's
  default (`--per-layer-executables on`): jaxgraph's Python alone is timed with stand-ins in
  each layer's copies (the run once failed there: the stand-ins were copied as executables),
  and an XLA option compiles into every executable (`--compiler-option`)."""
  run = run_script("probes.host_per_call", "--layers", "2", "--rounds", "2", "--steps", "2",
                   "--devices", "2", "--per-layer-executables", "on",
                   "--compiler-option", "xla_cpu_enable_fast_math=false", devices=2)
  result = json.loads(run.stdout.splitlines()[-1])
  assert result["devices"] == 2 and not result["replicated"]
  assert result["per_layer_executables"] is True
  assert result["compiler_options"] == {"xla_cpu_enable_fast_math": False}
  assert all(result[k] > 0 for k in ("us_per_call", "bare_us_per_call", "own_us_per_call",
                                     "cpu_us_per_call", "bare_cpu_us_per_call"))


@pytest.mark.cpu_only
def test_rng_call_times_a_keyed_layer_over_devices(run_script, tmp_path):
  """benchmarks/probes/rng_call.py times this tree's jaxgraph replaying a `rng=True` layer over
  2 devices and writes its line as JSON."""
  run_script("probes.rng_call", "--devices", "2", "--rounds", "2", "--calls", "2",
             "--json", str(tmp_path / "rng.json"), devices=2)
  result = json.loads((tmp_path / "rng.json").read_text())
  assert os.path.realpath(result["jaxgraph"]) == os.path.realpath(
      os.path.join(ROOT, "jaxgraph", "__init__.py"))
  assert result["devices"] == 2 and result["platform"] == "cpu"
  assert 0 < result["min_us"] <= result["median_us"]


@pytest.mark.cpu_only
def test_step_dispatch_finds_nothing_moved_or_slow_in_a_sharded_step(run_script, tmp_path):
  """benchmarks/probes/step_dispatch.py: the example's FSDP step with prefetch and dropout
  (key streams over the mesh) moves no argument before a call and takes jax's Python
  dispatch path for none (the pipeline's sums: test_schedule's host-work test)."""
  run_script("probes.step_dispatch", "--warmup", "1", "--steps", "1", "--json",
             str(tmp_path / "fsdp.json"), "--", "--preset", "tiny", "--fsdp", "2",
             "--prefetch", devices=2)
  found = json.loads((tmp_path / "fsdp.json").read_text())
  assert found["steps"] == 1 and found["example"][-1] == "--prefetch"
  assert found["moved"] == {} and found["python_path"] == {}


def _offload_bench():
  return _module("offload_bench")


def test_offload_bench_overlap_summary_of_a_synthetic_trace():
  """A copy to host half covered by a kernel on another stream; one to device not at all;
  a kernel on the copy's own stream does not count; summary lines are skipped."""
  meta = [dict(ph="M", pid=1, name="process_name", args=dict(name="/device:GPU:0")),
          dict(ph="M", pid=1, tid=1, name="thread_name", args=dict(name="Stream #1(Compute)")),
          dict(ph="M", pid=1, tid=2, name="thread_name", args=dict(name="Stream #2(MemcpyD2H)")),
          dict(ph="M", pid=1, tid=3, name="thread_name", args=dict(name="XLA Ops"))]
  spans = [dict(ph="X", pid=1, tid=1, name="gemm", ts=0, dur=50),
           dict(ph="X", pid=1, tid=3, name="fusion", ts=0, dur=1000),
           dict(ph="X", pid=1, tid=2, name="MemcpyD2H", ts=0, dur=100),
           dict(ph="X", pid=1, tid=2, name="copy_kernel", ts=100, dur=100),
           dict(ph="X", pid=1, tid=2, name="MemcpyH2D", ts=300, dur=100)]
  summary = _offload_bench().overlap_summary(meta + spans)
  assert summary["to_host"]["overlap_fraction"] == 0.5
  assert summary["to_device"]["overlap_fraction"] == 0.0
  assert summary["to_host"]["streams"] == ["Stream #2(MemcpyD2H)"]
  assert summary["kernels"] == 2 and summary["device_lines"]["XLA Ops"] == 1


def test_offload_bench_variant_names():
  bench = _offload_bench()
  assert bench.parse_variant("async-but-2", 4).flags == (True, True, False, False)
  assert bench.parse_variant("async-first-1", 3).flags == (True, False, False)
  assert bench.parse_variant("exe-all", 2).mode == "executable"
  assert bench.parse_variant("async-min64", 2).min_bytes == 64 << 20
  assert bench.parse_variant("async-names", 2).names == ("matmul_input",)


@pytest.mark.parametrize("cudnn", [False, True], ids=["xla", "cudnn"])
def test_default_attention_follows_the_backend(platform_gate, cudnn):
  """Both sides of the benchmarks' attention gate, forced here (conftest.py). Only the
  choice: cuDNN attention itself does not compile for XLA:CPU."""
  from benchmarks import harness

  assert harness.CUDNN_PLATFORMS == {"gpu"}
  platform_gate(harness, "CUDNN_PLATFORMS", cudnn)
  assert harness.attention(None) == ("cudnn" if cudnn else None)
  assert harness.attention("xla") == "xla"
  assert harness.attention("default") is None


@pytest.mark.cpu_only
def test_lora_bench_tiny_reports_both_variants(run_script, tmp_path):
  """benchmarks/lora_bench.py times the backward of a LoRA stack with and without
  `grad_mask`; its masked backward has the two frozen base weights' dW matmuls fewer."""
  run = run_script("lora_bench", "--tiny", "--out", str(tmp_path))
  assert "| lora |" in run.stdout and "lora / full:" in run.stdout
  with open(tmp_path / "lora_bench.json") as f:
    result = json.load(f)
  full, lora = result["variants"]["full"], result["variants"]["lora"]
  for variant in (full, lora):
    assert len(variant["rounds_ms"]) == 3 and variant["backward_ms"] > 0
  assert lora["backward_matmuls_per_layer"] == full["backward_matmuls_per_layer"] - 2


@pytest.mark.cpu_only
def test_cpu_collective_deadlock_probe_reports_each_setting(run_script):
  """benchmarks/probes/cpu_collective_deadlock.py trains plain-JAX FSDP layers on 8 CPU
  devices in child processes and reports, per waiting interval, the copies that finished,
  those XLA's runtime aborted in a collective and any other end (one light copy: it
  finishes)."""
  # A copy stuck past --deadline is killed and reported, well before the run's timeout.
  run = run_script("probes.cpu_collective_deadlock", "--processes", "1", "--steps", "3",
                   "--wait-every", "0", "1", "--deadline", "300")
  result = json.loads(run.stdout.strip().splitlines()[-1])
  assert [r["wait_every"] for r in result["results"]] == [0, 1]
  for r in result["results"]:
    assert (r["finished"], r["aborted"], r["killed"], r["other"]) == (1, 0, 0, 0)
    assert r["copies"][0]["steps_dispatched"] == 3


@pytest.mark.cpu_only
def test_llama_fsdp_tiny_records_each_row(run_script, tmp_path):
  """benchmarks/llama_fsdp.py runs a row per preset:N in fresh processes (one driving the N
  devices, and N of one device each) and writes the record's lines: the facts of the run and
  a row line per row and process layout, with the collectives of each executable."""
  record = tmp_path / "fsdp.txt"
  run = run_script("llama_fsdp", "--rows", "tiny:2", "--per-process", "--rounds", "1",
                   "--round-steps", "1", "--clients", "tfrt", "--out", str(tmp_path),
                   "--record", str(record))
  facts, rows = _module("llama_fsdp").read_record(record.read_text())
  assert list(facts) == ["commit", "device", "jax", "xla_flags", "date", "command"]
  assert [(row["n"], row["processes"], row["client"]) for row in rows] == [
      ("2", "1", "tfrt"), ("2", "2", "tfrt")]
  for row in rows:
    assert float(row["graphed"]) > 0 and float(row["whole"]) > 0
    assert abs(float(row["ratio"]) - float(row["graphed"]) / float(row["whole"])) < 1e-3
  found = json.loads((tmp_path / "llama_fsdp.json").read_text())
  assert found[0]["collectives"]["Block[1] forward"] == {"all-gather f32": 1}  # bf16 on GPUs
  here = os.path.realpath(os.path.join(ROOT, "jaxgraph", "__init__.py"))
  assert [os.path.realpath(row["jaxgraph"]) for row in found] == [here, here]  # which tree ran
  # the client's variable reached each row's processes (the CPU backend does not read it)
  assert [row["client_variable"] for row in found] == ["1", "1"]
  assert "tiny:2" in run.stdout


def test_llama_fsdp_kills_a_row_that_hangs_and_keeps_what_it_printed():
  """--row-timeout: a row's processes still running past it are killed, each one's output
  kept; processes that end in time are waited for."""
  finish = _module("llama_fsdp").finish

  def start(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

  began = time.monotonic()
  procs = [start("print('done')"), start("import time; print('waiting', flush=True); "
                                          "time.sleep(60)")]
  logs, hung = finish(procs, timeout=5)
  assert hung and time.monotonic() - began < 30
  assert logs[0].strip() == "done" and logs[1].strip() == "waiting"
  assert procs[0].returncode == 0 and procs[1].returncode != 0  # killed
  logs, hung = finish([start("print('in time')")], timeout=60)
  assert not hung and logs == ["in time\n"]


def test_llama_fsdp_alternates_the_clients_of_each_row():
  """--clients runs each row under each client, and --repeat reverses their order each time
  over, so a row's clients alternate (fresh processes each)."""
  runs = _module("llama_fsdp").planned_runs(["gpu:1", "gpu:2:--fuse 12"], per_process=True,
                                            clients=["default", "tfrt"], repeat=2)
  assert runs == [("gpu", 1, "", 1, "default"), ("gpu", 1, "", 1, "tfrt"),
                  ("gpu", 2, "--fuse 12", 1, "default"), ("gpu", 2, "--fuse 12", 1, "tfrt"),
                  ("gpu", 2, "--fuse 12", 2, "default"), ("gpu", 2, "--fuse 12", 2, "tfrt"),
                  ("gpu", 1, "", 1, "tfrt"), ("gpu", 1, "", 1, "default"),
                  ("gpu", 2, "--fuse 12", 1, "tfrt"), ("gpu", 2, "--fuse 12", 1, "default"),
                  ("gpu", 2, "--fuse 12", 2, "tfrt"), ("gpu", 2, "--fuse 12", 2, "default")]


def test_llama_fsdp_record_keeps_each_field_whole(monkeypatch):
  """A record's values may hold spaces (a device kind, several XLA flags, a row's flags, a
  failed row's error): its facts read back by key and its rows field by field. A row that
  failed (as one did on 4 GPUs, its error then written with spaces) is a row line too."""
  llama_fsdp = _module("llama_fsdp")
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true --xla_dump_to=/tmp/x")
  rates = {"median": 1000.0, "spread_percent": 1.0, "rounds": [990.0, 1000.0, 1010.0]}
  done = {"preset": "gpu", "n": 4, "flags": "--fuse 4", "processes": 1, "concurrent": 2,
          "client": "tfrt",
          "rates": {"graphed": rates, "whole_step": {**rates, "median": 1250.0}},
          "graphed_peak_bytes": 2**31, "whole_planned_peak_bytes": 2**32,
          "device_kind": "NVIDIA H200",
          "calls": {"block_forward_us": 101.5, "block_backward_us": 99.0}}
  failed = {"preset": "gpu", "n": 4, "flags": "", "processes": 4, "concurrent": 1,
            "client": "default", "error": "exit codes -6,0,0,0",
            "log": "Fatal Python error: Aborted"}
  lines = llama_fsdp.record_lines([done, failed], "python3 llama_fsdp.py --rows 'gpu:4:--fuse 4'",
                                  commit="abc")
  facts, rows = llama_fsdp.read_record("\n".join(lines) + "\n")
  assert facts == {"commit": "abc", "device": "NVIDIA H200, rows on up to 4 of them",
                   "jax": jax.__version__,
                   "xla_flags": "--xla_gpu_deterministic_ops=true --xla_dump_to=/tmp/x",
                   "date": facts["date"],
                   "command": "python3 llama_fsdp.py --rows 'gpu:4:--fuse 4'"}
  assert rows[0] == {"preset": "gpu", "n": "4", "graphed": "1000", "whole": "1250",
                     "ratio": "0.800", "spread": "1.0%", "processes": "1", "flags": "--fuse_4",
                     "prefetch": "off", "client": "tfrt",
                     "concurrent": "2", "rounds": "3", "graphed_peak_gib": "2.00",
                     "whole_planned_gib": "4.00", "block_forward_us": "101.5",
                     "block_backward_us": "99.0"}
  assert rows[1] == {"preset": "gpu", "n": "4", "processes": "4", "flags": "-",
                     "client": "default", "error": "exit_codes_-6,0,0,0"}
  # The line the earlier format wrote for a failed row: its error's spaces split it.
  with pytest.raises(ValueError, match=r"row fields without '=' \['codes', '\[1,', \"0\]'\"\]"):
    llama_fsdp.read_record("row preset=tiny n=2 processes=2 flags=- error='exit codes [1, 0]'")


@pytest.mark.cpu_only
def test_client_hang_runs_every_plain_case_under_each_client(run_script, tmp_path):
  """benchmarks/probes/client_hang.py runs each plain-JAX case over 4 virtual devices in a
  fresh process per client (the client variables are harmless on the CPU): every case ran,
  computed numpy's numbers and has the collective it is named for; the child saw its
  client's variable; donating changes no loss."""
  client_hang = _module("probes.client_hang")
  run = run_script("probes.client_hang", "--clients", "default", "tfrt", "--timeout", "40",
                   "--collectives", "--out", str(tmp_path), devices=4)
  found = json.loads((tmp_path / "client_hang.json").read_text())
  rows = found["rows"]
  assert [(row["case"], row["client"]) for row in rows] == [
      (case, client) for case in client_hang.SYNTHETIC for client in ("default", "tfrt")]
  for row in rows:
    assert row["status"] == "ok" and row["result"]["correct"], row
    assert row["result"]["devices"] == 4 and row["seconds"] > 0
    assert row["result"]["environment"] == {
        client_hang.TFRT_VARIABLE: "1" if row["client"] == "tfrt" else None,
        client_hang.ASYNC_VARIABLE: None}
    # the child's threads by name (Linux, where the CI runs): its own and the runtime's
    threads = row["result"]["threads"]
    assert sum(threads.values()) > 1 and all(isinstance(n, str) for n in threads), threads
    assert row["command"].startswith(
        "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1 python3 -m" if row["client"] == "tfrt"
        else "python3 -m")
  assert found["first_failure"] == {"default": None, "tfrt": None}
  by_case = {row["case"]: row["result"] for row in rows if row["client"] == "default"}
  for case in ("all-gather", "reduce-scatter", "all-reduce"):
    assert list(by_case[case]["collectives"].values()) == [{case: 1}]
  # the step's gradients: a reduce-scatter on GPUs, an all-reduce sliced on the CPU
  assert by_case["fsdp-step-donated"]["collectives"]["step"]["all-gather"] == 2
  assert by_case["fsdp-step-donated"]["losses"] == by_case["fsdp-step"]["losses"]
  assert set(by_case["two-executables"]["collectives"]) == {"forward", "backward"}
  assert "smallest case that fails" not in run.stdout and "every case ran" in run.stdout


def test_client_hang_records_a_hang_and_a_crash(tmp_path):
  """client_hang.py's child runner: a process past its timeout is killed and recorded as
  `hang` at its last stage; one that dies of a signal as `crash` with the signal."""
  client_hang = _module("probes.client_hang")
  env = client_hang.client_environment("tfrt", {"PATH": os.environ.get("PATH", "")})
  assert env[client_hang.TFRT_VARIABLE] == "1" and env["NCCL_NVLS_ENABLE"] == "0"
  hung = client_hang.run_child(
      [sys.executable, "-c", "import time; print('stage: call 1', flush=True); time.sleep(60)"],
      env, timeout=1)
  assert hung["status"] == "hang" and hung["stage"] == "call 1" and hung["returncode"] is None
  crashed = client_hang.run_child(
      [sys.executable, "-c", "import os; print('{\"partial\": 1}', flush=True); os.abort()"],
      env, timeout=30)
  assert crashed["status"] == "crash" and crashed["signal"] == "SIGABRT"
  assert crashed["result"] == {"partial": 1}


@pytest.mark.cpu_only
def test_fsdp_prefetch_tiny_checks_and_times_each_variant(run_script, tmp_path):
  """benchmarks/probes/fsdp_prefetch.py builds a plain-JAX FSDP step on 4 virtual devices as
  one jit, per-layer executables and prefetching ones, checks every variant's gradients
  against the whole step's (bitwise on the CPU but per-layer-2's, whose two-layer
  executable rounds otherwise), times them and counts each executable's collectives."""
  run = run_script("probes.fsdp_prefetch", "--tiny", "--out", str(tmp_path), devices=4)
  result = json.loads((tmp_path / "fsdp_prefetch.json").read_text())
  assert result["meta"]["devices"] == 4 and "count=4" in result["meta"]["xla_flags"]
  variants = result["variants"]
  assert list(variants) == ["whole", "whole-regather", "per-layer", "per-layer-2", "prefetch",
                            "prefetch-keep"]
  assert result["correct"] and "correctness: every variant within" in run.stdout
  for name, r in variants.items():
    assert r["correct"]["ok"] and r["step_ms"]["median"] > 0 and r["vs_whole"] > 0, name
    assert r["correct"]["bitwise"] or name == "per-layer-2", (name, r["correct"])

  def count(variant, executable, op):
    found = variants[variant]["collectives"][executable]
    return sum(v["count"] for k, v in found.items() if k.split()[0] == op)

  layers = result["meta"]["size"]["layers"]
  assert count("whole", "step", "all-gather") == layers  # the forward's gathers kept
  assert count("whole-regather", "step", "all-gather") == 2 * layers
  assert count("whole-regather", "step", "reduce-scatter") == layers
  assert [count("prefetch", exe, op) for exe in ("forward_prefetch", "forward_top",
                                                  "backward_prefetch", "backward_bottom")
          for op in ("all-gather", "reduce-scatter")] == [1, 0, 0, 0, 1, 1, 0, 2]
  # the forward's gathered weights kept for the backward: no gather there, one a layer
  assert [count("prefetch-keep", exe, op) for exe in ("forward_prefetch", "backward_top",
                                                       "backward_reduce", "backward_bottom")
          for op in ("all-gather", "reduce-scatter")] == [1, 0, 0, 0, 0, 1, 0, 2]
  runs = {"gather": 1, "forward_prefetch": layers - 1, "forward_top": 1, "loss": 1,
          "backward_top": 1, "backward_prefetch": layers - 2, "backward_reduce": layers - 2,
          "backward_bottom": 1}  # calls per step
  for name, gathers in (("prefetch", 2 * layers - 1), ("prefetch-keep", layers)):
    assert sum(runs[exe] * count(name, exe, "all-gather") for exe in variants[name]["collectives"]
               ) == gathers, name
    assert sum(runs[exe] for exe in variants[name]["collectives"]) == variants[name]["calls"]
    assert variants[name]["runs"] == {exe: runs[exe] for exe in variants[name]["collectives"]}
    assert variants[name]["collectives_per_step"]["all-gather"] == gathers, name
  assert variants["prefetch"]["calls"] == variants["prefetch-keep"]["calls"] == 2 * layers + 2


@pytest.mark.cpu_only
def test_fsdp_prefetch_tiny_keeps_gathered_weights_across_microbatches(run_script, tmp_path):
  """fsdp_prefetch.py with 2 microbatches a step: the whole step gathers each layer once a
  step and reduce-scatters each microbatch's gradient; prefetch gathers again in every
  microbatch; prefetch-step keeps every layer's gathered weights for the step (its later
  microbatches' forwards gather nothing), bitwise the whole step on the CPU; prefetch-step-sum
  also sums the unreduced gradients and reduce-scatters them once a step (other rounding)."""
  run_script("probes.fsdp_prefetch", "--tiny", "--microbatches", "2", "--variants", "prefetch",
             "prefetch-step", "prefetch-step-sum", "--out", str(tmp_path), devices=4)
  result = json.loads((tmp_path / "fsdp_prefetch.json").read_text())
  variants = result["variants"]
  assert list(variants) == ["whole", "prefetch", "prefetch-step", "prefetch-step-sum"]
  assert result["correct"]
  for name, r in variants.items():
    assert r["correct"]["ok"] and r["step_ms"]["median"] > 0, name
    assert r["correct"]["bitwise"] or name == "prefetch-step-sum", (name, r["correct"])
  layers, microbatches = result["meta"]["size"]["layers"], result["meta"]["size"]["microbatches"]
  assert microbatches == 2 and result["meta"]["size"]["tokens"] % microbatches == 0

  def per_step(name, op):  # from each executable's HLO times its calls in a step
    r = variants[name]
    found = sum(r["runs"][exe] * v["count"] for exe, by_type in r["collectives"].items()
                for k, v in by_type.items() if k.split()[0] == op)
    assert r["collectives_per_step"].get(op, 0) == found, (name, op)
    return found

  assert [(per_step(name, "all-gather"), per_step(name, "reduce-scatter"))
          for name in variants] == [
      (layers, layers * microbatches),  # whole: gathered once a step, reduced per microbatch
      (microbatches * (2 * layers - 1), layers * microbatches),  # prefetch: each microbatch's
      (layers, layers * microbatches),  # prefetch-step: as whole
      (layers, layers)]  # prefetch-step-sum: reduced once a step
  for name, r in variants.items():
    assert sum(r["runs"].values()) == r["calls"], name
  # the later microbatches' forwards take the kept gathered weights
  for name in ("prefetch-step", "prefetch-step-sum"):
    forward = variants[name]["collectives"]["forward"]
    assert not any(k.startswith("all-gather") for k in forward), name
    assert variants[name]["runs"]["forward"] == 1 + (microbatches - 1) * layers, name
  layer_bytes = result["meta"]["padded_per_layer"] * jax.numpy.dtype(jax.numpy.bfloat16).itemsize
  alive = {name: r["peak_alive"] for name, r in variants.items()}
  assert [alive[name]["gathered_layers"] for name in variants] == [layers, 2, layers, layers]
  assert alive["prefetch-step"]["gathered_bytes"] == layers * layer_bytes
  assert alive["prefetch-step-sum"]["grad_sum_layers"] == layers
  assert "grad_sum_layers" not in alive["prefetch-step"]


def test_fsdp_prefetch_reads_async_collectives_from_gpu_hlo():
  """The collective counts of fsdp_prefetch.py on HLO as XLA:GPU prints it: a native
  all-gather start/update/done pair with compute scheduled inside, one marked is_sync with
  none, and a reduce-scatter wrapped in async-start/async-done."""
  hlo = """HloModule m, is_scheduled=true

%add (p0: bf16[], p1: bf16[]) -> bf16[] {
  %p0 = bf16[] parameter(0)
  %p1 = bf16[] parameter(1)
  ROOT %add = bf16[] add(%p0, %p1)
}, execution_thread="parallel_thread"

%wrapped (param: bf16[8]) -> bf16[2] {
  %param = bf16[8]{0} parameter(0)
  ROOT %reduce-scatter.1 = bf16[2]{0} reduce-scatter(bf16[8]{0} %param), to_apply=%add
}

ENTRY %main.3 (p: bf16[8], q: bf16[2]) -> bf16[2] {
  %p = bf16[8]{0} parameter(0)
  %q = bf16[2]{0} parameter(1)
  %all-gather-start = (bf16[2]{0}, bf16[8]{0}) all-gather-start(bf16[2]{0} %q), ASYNC
  %all-gather-start.1 = (bf16[2]{0}, bf16[8]{0}) all-gather-start(bf16[2]{0} %q), SYNC
  %all-gather-done.1 = bf16[8]{0} all-gather-done((bf16[2]{0}, bf16[8]{0}) %all-gather-start.1)
  %reduce-scatter-start = ((bf16[8]{0}), bf16[2]{0}) async-start(bf16[8]{0} %p), calls=%wrapped
  %fusion = bf16[8]{0} fusion(%p), kind=kLoop, calls=%fused_computation
  %custom-call = bf16[8]{0} custom-call(%fusion), custom_call_target="__cublas$gemm"
  %reduce-scatter-done = bf16[2]{0} async-done(((bf16[8]{0}), bf16[2]{0}) %reduce-scatter-start)
  %all-gather-update = (bf16[2]{0}, bf16[8]{0}) all-gather-update(%all-gather-start)
  %call = bf16[8]{0} call(%p), to_apply=%command_buffer
  %all-gather-done = bf16[8]{0} all-gather-done((bf16[2]{0}, bf16[8]{0}) %all-gather-update)
  ROOT %all-reduce = bf16[2]{0} all-reduce(bf16[2]{0} %reduce-scatter-done), to_apply=%add
}
"""
  config = 'backend_config={"collective_backend_config":{"is_sync":%s}}'
  hlo = hlo.replace("ASYNC", config % "false").replace("SYNC", config % "true")
  found = _module("probes.fsdp_prefetch").hlo_collectives(hlo)
  assert found == {
      "all-gather bf16": {"count": 2, "async": 2, "sync_marked": 1, "compute_between": [3, 0]},
      "reduce-scatter bf16": {"count": 1, "async": 1, "sync_marked": 0, "compute_between": [2]},
      "all-reduce bf16": {"count": 1, "async": 0, "sync_marked": 0, "compute_between": []}}
