"""The PyTorch peers of `bench.py`: eager and `torch.cuda.make_graphed_callables`.

The same GPT block stack as `bench.py` (pre-LayerNorm attention + GELU MLP, dropout 0.1,
bf16, SGD), per-layer graphs as in `torch.cuda.make_graphed_callables`' own example. Run by
`bench.py` in a process of its own; prints one JSON line per variant.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

DROPOUT = 0.1
LR = 1e-3


class Block(nn.Module):
  """One GPT block: x + drop(proj(attn(ln1(x)))), then x + drop(fc2(gelu(fc1(ln2(x)))))."""

  def __init__(self, d: int, heads: int):
    super().__init__()
    self.heads = heads
    self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
    self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
    self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    b, t, d = x.shape
    q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(
        2, 0, 3, 1, 4)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
    x = x + F.dropout(self.proj(a), DROPOUT, self.training)
    return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), DROPOUT, self.training)


class Variant:
  """One way to run a training step: build it, then call `step()` repeatedly."""

  def __init__(self, name: str, size: dict[str, Any], graphed: bool):
    torch.manual_seed(0)
    d, b, t = size["d"], size["batch"], size["seq"]
    self.name = name
    self.layers = [Block(d, size["heads"]).cuda().to(torch.bfloat16)
                   for _ in range(size["layers"])]
    self.x0 = torch.randn(b, t, d, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start = time.perf_counter()
    if graphed:
      samples = tuple((torch.randn(b, t, d, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True),) for _ in self.layers)
      self.layers = list(torch.cuda.make_graphed_callables(tuple(self.layers), samples))
    torch.cuda.synchronize()
    self.capture_s = time.perf_counter() - start
    self.optimizer = torch.optim.SGD([p for layer in self.layers for p in layer.parameters()],
                                     lr=LR)
    # Replays per step: one forward and one backward graph per layer when graphed.
    self.executables = 2 * len(self.layers) if graphed else None

  def step(self) -> None:
    x = self.x0.clone().requires_grad_(True)
    for layer in self.layers:
      x = layer(x)
    x.float().pow(2).mean().backward()
    self.optimizer.step()
    self.optimizer.zero_grad(set_to_none=False)


def _time(step: Callable[[], None], iters: int) -> float:
  torch.cuda.synchronize()
  start = time.perf_counter()
  for _ in range(iters):
    step()
  torch.cuda.synchronize()
  return 1e3 * (time.perf_counter() - start) / iters


def run(size: dict[str, Any], iters: int, reps: int) -> list[dict[str, Any]]:
  """Builds both variants, times them interleaved, returns one record per variant."""
  variants = [Variant("torch-eager", size, graphed=False),
              Variant("torch-graphed", size, graphed=True)]
  peaks = {}
  for v in variants:
    for _ in range(3):
      v.step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    v.step()
    torch.cuda.synchronize()
    peaks[v.name] = torch.cuda.max_memory_allocated()
  times: dict[str, list[float]] = {v.name: [] for v in variants}
  for rep in range(reps):
    order = variants if rep % 2 == 0 else variants[::-1]
    for v in order:
      times[v.name].append(_time(v.step, iters))
  records = []
  for v in variants:
    host = []
    for _ in range(max(reps, 5)):
      torch.cuda.synchronize()
      start = time.perf_counter()
      v.step()
      host.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    host_us = 1e6 * statistics.median(host)
    records.append(dict(
        framework="torch", variant=v.name, size=size["name"], step_ms=times[v.name],
        capture_s=v.capture_s, peak_bytes=peaks[v.name],
        host_us_per_executable=host_us / v.executables if v.executables else None,
        host_us_per_step=host_us, executables_per_step=v.executables))
  return records


def main(argv: list[str]) -> None:
  config = json.loads(argv[0])
  meta = dict(framework="torch", torch=torch.__version__, gpu=torch.cuda.get_device_name())
  print(json.dumps(dict(meta=meta)), flush=True)
  for size in config["sizes"]:
    for record in run(size, config["iters"], config["reps"]):
      print(json.dumps(dict(record=record)), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
