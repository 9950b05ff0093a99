"""Host time of replayed executables by part, from a py-spy `--native --format raw` profile.

`profile_replay.py --sample-seconds N` writes the collapsed stacks (`native_<variant>.txt`)
and how many steps and executable calls ran while they were sampled (`native_<variant>.json`);
`llama_breakdown.py --native N` writes the same for the Llama step. Each sample is charged to
the innermost part found on its stack (the specific parts first, then the generic ones), so
the parts add up to the whole.

  python3 benchmarks/probes/native_breakdown.py /tmp/profile/native_jaxgraph.txt
"""

from __future__ import annotations

import collections
import json
import os
import sys

# (part, substrings of a frame): a sample goes to the part found innermost on its stack.
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("command buffer: cuDNN graph update", ("UpdateDnnGraph", "update_cuda_graph")),
    ("command buffer: record / update", ("CommandExecutor::Record", "CommandBuffer::Update",
                                         "cuGraphExec")),
    ("launch (cuGraphLaunch, kernel launch)", ("cuGraphLaunch", "cuLaunchKernel",
                                               "CommandBuffer::Submit")),
    ("output arrays: create", ("CreateOutputs", "PjRtArray::PjRtArray", "PyArray::PyArray",
                               "MakeArray")),
    ("arrays: destroy (last step's buffers)", ("PyArray_tp_dealloc", "~PjRtArray",
                                               "~PjRtCApiBuffer", "PJRT_Buffer_Destroy",
                                               "Delete")),
    ("arguments: parse, check, prepare", ("ParseArguments", "PyArgSignature", "PrepareArguments",
                                          "ExecutePrepare", "IsDeleted", "layout")),
    ("buffer allocation", ("GenerateBufferAllocations", "BufferForAllocation", "Allocate")),
    ("events, streams, sync", ("Event", "ThenExecuteCallback", "Mutex", "mutex")),
)
# Where no part above is on the stack: the innermost of these.
GENERIC: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("rest of the runtime's execute path", ("xla::", "pjrt::", "PjitFunction",
                                            "Compiled.__call__", "jax::")),
    ("jaxgraph Python", ("jaxgraph/",)),
    ("benchmark loop, other Python", ("",)),
)


def breakdown(stacks_path: str) -> tuple[dict[str, int], int]:
  """Samples per part (`PARTS`), and the total."""
  counts: dict[str, int] = collections.Counter()
  total = 0
  with open(stacks_path) as f:
    for line in f:
      stack, _, n = line.rstrip("\n").rpartition(" ")
      if not stack:
        continue
      frames = stack.split(";")[::-1]
      total += int(n)
      counts[_part(frames)] += int(n)
  return counts, total


def _part(frames: list[str]) -> str:
  for parts in (PARTS, GENERIC):
    for frame in frames:
      for part, needles in parts:
        if any(needle in frame for needle in needles):
          return part
  raise AssertionError("the last generic part matches every frame")


def main() -> None:
  path = sys.argv[1]
  counts, total = breakdown(path)
  meta_path = os.path.splitext(path)[0] + ".json"
  meta = json.load(open(meta_path)) if os.path.exists(meta_path) else None
  us_per_call = (1e6 * meta["seconds"] / meta["calls"]) if meta else None
  print(f"{'part':42s} {'share':>7s}" + (f" {'µs/call':>8s}" if meta else ""))
  for part, _ in PARTS + GENERIC:
    share = counts.get(part, 0) / total
    line = f"{part:42s} {100 * share:6.1f}%"
    if meta:
      line += f" {share * us_per_call:8.1f}"
    print(line)
  if meta:
    print(f"{'all (wall time / executable calls)':42s} {100.0:6.1f}% {us_per_call:8.1f}")
    print(json.dumps(meta))


if __name__ == "__main__":
  main()
