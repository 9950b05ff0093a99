"""Smoke test of benchmarks/bench.py at tiny sizes: it runs and reports every variant.

No timing thresholds: timings belong in docs/performance.md, not in pass/fail tests.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_tiny_reports_every_variant(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  run = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "--tiny", "--no-probes",
       "--iters", "1", "--reps", "1", "--out", str(tmp_path)],
      capture_output=True, text=True, env=env, timeout=900, check=False)
  assert run.returncode == 0, run.stderr[-4000:]
  with open(tmp_path / "bench.json") as f:
    result = json.load(f)
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  try:
    import bench
  finally:
    sys.path.pop(0)
  reported = {r["variant"]: r for r in result["records"]}
  for name in bench.JAX_VARIANTS:
    record = reported[name]
    assert record["size"] == "tiny"
    assert record["step"]["median"] > 0 and min(record["step_ms"]) > 0
    assert record["capture_s"] > 0
    assert record["host_us_per_executable"] > 0
  for name in bench.TORCH_VARIANTS:
    assert name in reported or name in result["meta"]["skipped"]
  assert (tmp_path / "bench.png").exists() or "no plot" in run.stdout


def test_llama_breakdown_tiny_reports_each_part(tmp_path):
  """benchmarks/llama_breakdown.py follows the Llama example it measures (it builds the
  example's trainer and whole step): it runs at the tiny preset and reports its parts."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  run = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "llama_breakdown.py"), "--preset",
       "tiny", "--rounds", "1", "--steps", "1", "--variants", "recompute", "--out",
       str(tmp_path)],
      capture_output=True, text=True, env=env, timeout=900, check=False)
  assert run.returncode == 0, run.stderr[-4000:]
  with open(tmp_path / "breakdown.json") as f:
    found = json.load(f)["variants"]["recompute"]
  assert found["call"]["arrays_per_vjp"] >= 2 and found["call"]["vjp_host_us"] > 0
  assert found["step"]["graphed_tok_s"] > 0 and found["step"]["whole_tok_s"] > 0


def test_fusion_probe_tiny_reports_each_variant(tmp_path):
  """benchmarks/fusion_probe.py builds per-layer, fused and diagnostic variants of GPT and
  the Llama example, and reports their timings, host costs and executables (no GPU trace
  on the CPU)."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  run = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "fusion_probe.py"), "--tiny", "--out",
       str(tmp_path)],
      capture_output=True, text=True, env=env, timeout=900, check=False)
  assert run.returncode == 0, run.stderr[-4000:]
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
