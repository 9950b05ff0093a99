#!/usr/bin/env bash
# What a training step of the Llama example asks of the host on 4 GPUs and on one, in one run
# of about 5 minutes: for `--preset gpu --fsdp 4 --batch 64`, the same with `--fuse 12`, and
# `--preset gpu` on one GPU, each one process of benchmarks/probes/llama_step_host.py: the
# executable calls a step makes by kind and the host time of each, a timeline of a few steps
# (each dispatch's start and length, waits, transfers, whether the devices were idle when a
# call came), a burst of steps under py-spy --native split by native_breakdown.py's parts,
# and --check's tokens/s of the graphed and the whole step with the host's time per step of
# each.
#
#   bash benchmarks/probes/llama_step_gpu.sh [OUT]     # from the repository root
#
# OUT (default $OUT, else /tmp/llama_step): summary.txt (each row's summary and profile
# parts), log.txt (everything the runs printed), ROW/{summary.json,timeline.json,native.txt,
# native.json}. py-spy comes from a wheel in .whl/ (installed into /tmp/site) where it is not
# on the PATH; without it the rows run without a profile. The BPE vocabulary is trained by
# the first row (runs/cache; carried there, no row trains it).
#
# A dry run on the CPU (4 virtual devices, the tiny preset; a few minutes on 2 cores):
#   LLAMA_STEP_PRESET=tiny LLAMA_STEP_FUSE=2 JAX_PLATFORMS=cpu \
#     XLA_FLAGS=--xla_force_host_platform_device_count=4 \
#     LLAMA_STEP_TIMING="--steps 12 --rounds 2 --round-steps 3" LLAMA_STEP_LIMIT=300 \
#     bash benchmarks/probes/llama_step_gpu.sh /tmp/llama_step
set -u
out=${1:-${OUT:-/tmp/llama_step}}
mkdir -p "$out"
log=$out/log.txt
export PYTHONUNBUFFERED=1
if ! command -v py-spy >/dev/null && ls .whl/py_spy-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      .whl/py_spy-*.whl >>"$log" 2>&1 && export PATH=/tmp/site/bin:$PATH
fi
{ nvidia-smi -L; python3 -c "import jax; print(jax.__version__, jax.devices())"; } >>"$log" 2>&1

preset=${LLAMA_STEP_PRESET:-gpu}
fuse=${LLAMA_STEP_FUSE:-12}
# The run's steps: the timeline's (4-6) and the profile's (7-11) inside them; --check's
# timing rounds after them.
read -r -a timing <<<"${LLAMA_STEP_TIMING:---steps 16 --rounds 3 --round-steps 10}"
read -r -a probe <<<"${LLAMA_STEP_PROBE:---first 4 --timeline-steps 3 --profile-steps 5}"

row() {  # row LABEL TIMEOUT ARGS...: one process; its files go to $out/LABEL
  local label=$1 limit=${LLAMA_STEP_LIMIT:-$2}; shift 2
  echo "== $label: $*" | tee -a "$log"
  timeout "$limit" python3 -m benchmarks.probes.llama_step_host --out "$out/$label" \
      "${probe[@]}" -- --preset "$preset" "${timing[@]}" --generate 0 "$@" >>"$log" 2>&1 \
      || echo "== $label failed ($?)" | tee -a "$log"
}

row gpu4 150 --fsdp 4 --batch 64
row gpu4_fuse$fuse 120 --fsdp 4 --batch 64 --fuse "$fuse"
CUDA_VISIBLE_DEVICES=0 row gpu1 100

for dir in "$out"/*/; do
  label=$(basename "$dir")
  [ -f "$dir/summary.json" ] || continue
  {
    echo "=== $label"
    python3 - "$dir/summary.json" <<'EOF'
import json, sys
from benchmarks.probes.llama_step_host import report
summary = json.load(open(sys.argv[1]))
print(" ".join(summary["train_args"]), f"({summary['devices']} devices)")
print(report(summary))
EOF
    if [ -f "$dir/native.txt" ]; then
      echo "-- burst profile (µs/call: the burst's host seconds over its calls)"
      python3 -m benchmarks.probes.native_breakdown "$dir/native.txt"
    fi
    echo
  } >>"$out/summary.txt" 2>>"$log"
done
cat "$out/summary.txt"
