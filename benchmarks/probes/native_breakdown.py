"""Host time of replayed executables by part, from a py-spy `--native --format raw` profile.

`profile_replay.py --sample-seconds N` writes the collapsed stacks (`native_<variant>.txt`)
and how many steps and executable calls ran while they were sampled (`native_<variant>.json`);
`llama_breakdown.py --native N` and `host_per_call.py --profile PREFIX` write the same for the
Llama step and for small layers' calls. Each sample is charged to the innermost part found on
its stack (the specific parts first, then the generic ones), so the parts add up to the
whole; the samples include the main thread's waits (`py-spy --idle`), so the parts add up to
the wall time. The other devices' launches run on PjRt's threads, which py-spy does not see:
the main thread's wait for them is the `wait` part.

  python3 -m benchmarks.probes.native_breakdown /tmp/profile/native_jaxgraph.txt
"""

from __future__ import annotations

import collections
import json
import os
import sys

# (part, substrings of a frame): a sample goes to the part found innermost on its stack; in
# one frame, to the part listed first.
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("collectives: cliques, rendezvous, NCCL", ("Rendezvous", "Clique", "Nccl", "NCCL", "nccl",
                                               "Collective")),
    ("command buffer: cuDNN graph update", ("UpdateDnnGraph", "update_cuda_graph")),
    ("launch (cuGraphLaunch, kernel launch)", ("cuGraphLaunch", "cuLaunchKernel",
                                               "CommandBuffer::Submit", "LaunchKernel")),
    ("command buffer: record / update", ("CommandExecutor::Record", "CommandBuffer::Update",
                                         "cuGraphExec", "CommandBuffer", "cuGraph")),
    ("thunks on the host (other)", ("ExecuteThunks", "Thunk::Execute", "ThunkExecutor")),
    ("output arrays: create", ("CreateOutputs", "PjRtArray::PjRtArray", "PyArray::PyArray",
                               "MakeArray")),
    ("arrays: destroy (last step's buffers)", ("PyArray_tp_dealloc", "~PjRtArray",
                                               "~PjRtCApiBuffer", "PJRT_Buffer_Destroy",
                                               "Delete", "~PjRtStreamExecutorBuffer",
                                               "~CommonPjRtBuffer", "~TrackedDeviceBuffer",
                                               "Deallocate")),
    ("arguments: parse, check, prepare", ("ParseArguments", "PyArgSignature", "PrepareArguments",
                                          "ExecutePrepare", "IsDeleted", "layout", "ShardArg",
                                          "PyArray", "Transfer")),
    ("buffer allocation", ("GenerateBufferAllocations", "BufferForAllocation", "Allocate")),
)
# The frame of the calls `profiling.sample_native` times: where a profile has it, only the
# samples under it count (not py-spy's start and end around them).
SAMPLED = "_sampled ("
# Where no part above is on the stack: the innermost of these (the waits, the hand-offs and
# the locks of an execution's own set-up, a rendezvous say, count as that set-up).
HOST_SIDE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("wait (other devices' launches, events)", ("pthread_cond_wait", "pthread_cond_timedwait",
                                                "futex_wait", "BlockingCounter",
                                                "WaitForNotification", "CondVar::Wait",
                                                "sem_wait", "BlockHostUntilDone")),
    ("launch per device (PjRt, thread pool)", ("LaunchOnDevice", "ThreadPool",
                                               "AsyncWorkRunner", "EventCount",
                                               "pthread_cond_signal")),
    ("events, streams, sync", ("Event", "ThenExecuteCallback", "Mutex", "mutex")),
)
# Where none of the parts above is on the stack: the innermost of these.
GENERIC: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("rest of the runtime's execute path", ("xla::", "pjrt::", "PjitFunction",
                                            "Compiled.__call__", "jax::")),
    ("jaxgraph Python", ("jaxgraph/",)),
    ("benchmark loop, other Python", ("",)),
)
def breakdown(stacks_path: str) -> tuple[dict[str, int], int]:
  """Samples per part (`PARTS`), and the total; only those under `SAMPLED` where any is."""
  with open(stacks_path) as f:
    samples = [(stack, int(n)) for stack, _, n in
               (line.rstrip("\n").rpartition(" ") for line in f) if stack]
  if any(SAMPLED in stack for stack, _ in samples):
    samples = [(stack, n) for stack, n in samples if SAMPLED in stack]
  counts: dict[str, int] = collections.Counter()
  for stack, n in samples:
    counts[_part(stack.split(";")[::-1])] += n
  return counts, sum(n for _, n in samples)


def _part(frames: list[str]) -> str:
  for parts in (PARTS, HOST_SIDE, GENERIC):
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
  for part, _ in PARTS + HOST_SIDE + GENERIC:
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
