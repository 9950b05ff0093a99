#!/usr/bin/env bash
# The host cost of a replayed call on a machine of 4 GPUs, in one run of about 3 minutes:
# benchmarks/probes/host_per_call.py's rows (1 GPU; 4 GPUs with collectives; 4 GPUs
# replicated, no collective; one process per GPU; 4 GPUs under XLA options that change an
# executable's per-execution set-up), and py-spy --native profiles of the replay at 1 and 4
# GPUs split by part of the runtime (native_breakdown.py).
#
#   bash benchmarks/probes/host_cost_gpu.sh [OUT]     # from the repository root
#
# OUT (default $OUT, else /tmp/host_cost): rows.jsonl (one result line per row, with its
# label), summary.txt (the rows as a table, then each profile's parts), log.txt (everything
# the runs printed), profiles.tar.gz (the collapsed stacks). py-spy comes from a wheel in
# .whl/ (installed into /tmp/site) where it is not on the PATH; without it the rows still run.
set -u
out=${1:-${OUT:-/tmp/host_cost}}
mkdir -p "$out"
work=$(mktemp -d)
log=$out/log.txt
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if ! command -v py-spy >/dev/null && ls .whl/py_spy-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      .whl/py_spy-*.whl >>"$log" 2>&1 && export PATH=/tmp/site/bin:$PATH
fi
{ nvidia-smi -L; python3 -c "import jax; print(jax.__version__, jax.devices())"; } >>"$log" 2>&1

probe=benchmarks.probes.host_per_call
# HOST_COST_TIMING: other timing flags (a CPU dry run: "--rounds 2 --steps 2 --layers 2")
read -r -a timing <<<"${HOST_COST_TIMING:---rounds 12 --steps 10 --profile-seconds 6}"

row() {  # row LABEL ARGS...: one process; its result line goes to $work/LABEL.json
  local label=$1; shift
  echo "== $label: $*" >>"$log"
  timeout 120 python3 -m "$probe" "${timing[@]}" --json "$work/$label.json" "$@" >>"$log" 2>&1 \
      || echo "== $label failed ($?)" >>"$log"
}

row gpu1 --devices 1 --profile "$work/gpu1"
row gpu4 --devices 4 --profile "$work/gpu4"
row gpu4_replicated --devices 4 --replicated
row gpu4_shared --devices 4 --per-layer-executables off

# One process per GPU: 4 processes of one GPU each, one jax.distributed run.
echo "== gpu4_processes" >>"$log"
port=$((20000 + RANDOM % 20000))
for i in 0 1 2 3; do
  CUDA_VISIBLE_DEVICES=$i timeout 180 python3 -m "$probe" "${timing[@]}" --devices 4 \
      --coordinator "127.0.0.1:$port" --num-processes 4 --process-id $i \
      --json "$work/gpu4_processes_$i.json" >"$work/process_$i.log" 2>&1 &
done
wait
cat "$work"/process_*.log >>"$log"

# XLA options of the executables (make_graphed(..., compiler_options=...)), 4 GPUs.
buffers=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION
row gpu4_cmdbuf_collectives --devices 4 \
    --compiler-option xla_gpu_enable_command_buffer=$buffers,COLLECTIVES
row gpu4_cmdbuf_collectives_min1 --devices 4 \
    --compiler-option xla_gpu_enable_command_buffer=$buffers,COLLECTIVES \
    --compiler-option xla_gpu_graph_min_graph_size=1
row gpu4_sync_collectives --devices 4 \
    --compiler-option xla_gpu_disable_async_collectives=ALLGATHER,REDUCESCATTER,ALLREDUCE
row gpu4_sync_cmdbuf_collectives --devices 4 \
    --compiler-option xla_gpu_disable_async_collectives=ALLGATHER,REDUCESCATTER,ALLREDUCE \
    --compiler-option xla_gpu_enable_command_buffer=$buffers,COLLECTIVES
# no command buffer: every region is below the size one needs ('' is no value to XLA)
row gpu4_no_cmdbuf --devices 4 --compiler-option xla_gpu_graph_min_graph_size=1000000
row gpu1_no_cmdbuf --devices 1 --compiler-option xla_gpu_graph_min_graph_size=1000000

# What XLA made of those options: each compiled once with a dump, its non-default
# DebugOptions and the command buffers of an all-gather's executable (grep'd from the dump).
python3 - "$buffers" >>"$log" 2>&1 <<'EOF'
import glob, sys, tempfile
import jax, jax.numpy as jnp
import jaxgraph as jg
buffers = sys.argv[1]
mesh = jg.fsdp.make_mesh(devices=jax.devices()[:4])
x = jax.device_put(jnp.ones((64, 64)), jg.fsdp.batch_sharding(mesh))
fn = jax.jit(lambda x: jnp.tanh(jg.fsdp.gather(x, mesh) @ jnp.ones((64, 64))).sum())
for options in ({}, {"xla_gpu_enable_command_buffer": buffers + ",COLLECTIVES"},
                {"xla_gpu_graph_min_graph_size": 1000000},
                {"xla_gpu_disable_async_collectives": "ALLGATHER,REDUCESCATTER,ALLREDUCE"}):
  with tempfile.TemporaryDirectory() as d:
    fn.lower(x).compile({**options, "xla_dump_to": d})
    debug = "".join(open(f).read() for f in glob.glob(f"{d}/*debug_options"))
    text = "".join(open(f).read() for f in glob.glob(f"{d}/*after_optimizations.txt"))
    print("== options", options, "\n" + debug.strip(), "\ncommand_buffer mentions:",
          text.count("command_buffer"), "all-gather ops:", text.count("all-gather"))
EOF

python3 - "$work" "$out" <<'EOF' >"$out/summary.txt" 2>>"$log"
import glob, json, os, subprocess, sys
work, out = sys.argv[1:]
rows = []
for path in sorted(glob.glob(os.path.join(work, "*.json"))):
  name = os.path.basename(path)[:-5]
  if name.endswith((".jaxgraph", ".bare")):
    continue  # a profile's steps and calls
  rows.append(dict(json.load(open(path)), label=name))
with open(os.path.join(out, "rows.jsonl"), "w") as f:
  f.writelines(json.dumps(r) + "\n" for r in rows)
cols = ("us_per_call", "bare_us_per_call", "own_us_per_call", "cpu_us_per_call",
        "bare_cpu_us_per_call", "spread_pct")
print(f"{'row':34s} {'µs/call':>8s} {'bare':>8s} {'own':>8s} {'cpu':>8s} {'bare cpu':>8s} "
      f"{'spread%':>8s} copies")
for r in rows:
  print(f"{r['label']:34s} " + " ".join(f"{r[c]:8.1f}" for c in cols)
        + f" {r['per_layer_copies']}")
for path in sorted(glob.glob(os.path.join(work, "*.txt"))):
  if path.endswith((".jaxgraph.txt", ".bare.txt")):
    print(f"\n{os.path.basename(path)}")
    print(subprocess.run([sys.executable, "-m", "benchmarks.probes.native_breakdown", path],
                         capture_output=True, text=True).stdout)
EOF
tar -czf "$out/profiles.tar.gz" -C "$work" $(cd "$work" && ls | grep -E '\.(jaxgraph|bare)\.(txt|json)$') \
    2>>"$log"
cat "$out/summary.txt"
