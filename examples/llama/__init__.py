"""The Llama example, one module per concern; `train.py` is the command and the run's story.

  model.py        the model, as an NNX user writes it (no jaxgraph in it)
  presets.py      the presets and the flags that override them
  data.py         the text, its vocabulary, the corpus and its batches
  layers.py       the model as graphed layers: split, tied head, make_graphed calls
  placement.py    where the state lives: one device or an --fsdp mesh; multi-process start
  fsdp_report.py  --fsdp: where each array lives, the collectives of each executable
  pipeline.py     --pipeline: stages, their order, the step through jg.schedule.Pipeline
  trainer.py      the graphed step (Trainer), the optimizer, the held-out loss
  whole_step.py   the same step as one whole-step jax.jit (--whole-step, --check)
  check.py        --check: the rerun, its comparison and report
  throughput.py   tokens/s: the loop's rounds, --check's alternating rounds
  memory.py       device memory: peak, training state, a preset's estimate
  offload.py      --offload: its spellings, the blocks measured, the plan
  generation.py   generation with a KV cache (prefill, decode)
  lora.py         --init-from, --lora: fine-tuning a trained run, LoRA adapters over it
  checkpoints.py  what checkpoints hold beside the state; --resume's checks and restore
  cli.py          the flags, checked before anything is built

Run it from the repository root as `python -m examples.llama.train`; what it shares with
train_gpt.py it imports from the `examples` package (`examples.checkpoints`,
`examples.corpus`, `examples.options`, ...). docs/llama.md.
"""
