#!/usr/bin/env bash
# jax's two GPU runtimes side by side on a machine of 4 GPUs: the StreamExecutor client
# (jax's default, synchronous dispatch) and async dispatch (a dispatch thread per device;
# `XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1`, named after XLA's TFRT client, which is gone:
# in jax 0.11 the variable turns on the default client's async dispatch; read by the CUDA
# plugin when the backend
# starts). Alternated, each row twice: benchmarks/probes/host_per_call.py at 4 GPUs (FSDP
# collectives) and at 1, then the Llama example `gpu --fsdp 4 --batch 64 --fuse 12` through
# benchmarks/llama_fsdp.py (graphed and sharded whole step alternated), each client's run
# writing its metrics so the losses can be compared bit for bit.
#
#   bash benchmarks/probes/tfrt_client_ab.sh [OUT]     # from the repository root
#
# OUT (default $OUT, else /tmp/tfrt_ab): calls.jsonl (host_per_call's result lines, each with
# its client and devices), fsdp-<client>.txt (llama_fsdp's record), log.txt.
set -u
out=${1:-${OUT:-/tmp/tfrt_ab}}
mkdir -p "$out"
log=$out/log.txt
export PYTHONUNBUFFERED=1
read -r -a timing <<<"${TFRT_AB_TIMING:---rounds 10 --steps 10}"
read -r -a llama <<<"${TFRT_AB_LLAMA:-gpu:4:--fuse 12 --batch 64}"

for round in 1 2; do
  for client in 0 1; do
    for devices in 4 1; do
      label="client=$([ $client = 1 ] && echo tfrt || echo se) devices=$devices round=$round"
      echo "== $label" >>"$log"
      XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=$client timeout 120 python3 -m \
          benchmarks.probes.host_per_call "${timing[@]}" --devices "$devices" \
          --json "$out/row.json" >>"$log" 2>&1 || { echo "== failed ($?)" >>"$log"; continue; }
      python3 -c 'import json, sys; row = json.load(open(sys.argv[1]))
row.update(client=sys.argv[2], round=int(sys.argv[3])); print(json.dumps(row))' \
          "$out/row.json" "$([ $client = 1 ] && echo tfrt || echo se)" "$round" >>"$out/calls.jsonl"
    done
  done
done
rm -f "$out/row.json"

for client in 0 1; do
  name=$([ $client = 1 ] && echo tfrt || echo se)
  echo "== llama_fsdp client=$name ${llama[*]}" >>"$log"
  XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=$client timeout "${TFRT_AB_LLAMA_LIMIT:-200}" python3 -m \
      benchmarks.llama_fsdp --rows "${llama[*]}" --gpus 4 --out "$out/fsdp-$name" \
      --record "$out/fsdp-$name.txt" >>"$log" 2>&1 || echo "== failed ($?)" >>"$log"
done
grep -h "^row" "$out"/fsdp-*.txt 2>/dev/null
cat "$out/calls.jsonl" 2>/dev/null
