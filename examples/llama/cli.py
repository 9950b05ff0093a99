"""The command line: every flag, checked before anything is built or removed (argparse
errors), and with --resume against the checkpoint's step and config (`parse`)."""

from __future__ import annotations

import argparse
import pathlib

from examples import vocabulary as vocab_lib
from examples.options import check_out, check_resume, check_steps, run_parser

from .checkpoints import check_vocabulary, run_config, shown_config
from .lora import check_flags as check_fine_tuning
from .layers import RESIDUAL_POLICIES
from .offload import OFFLOAD_CONFLICTS, OffloadSpec, offload_spec
from .pipeline import SCHEDULES, check_flags as check_pipeline
from .placement import check_fsdp
from .presets import PRESETS, resolve

# --help's description.
DESCRIPTION = ("Train the Llama-style model of model.py with every decoder block graphed, "
               "then generate.")


def vocab_size(text: str) -> int:
  """--vocab: a number of BPE tokens, or 'chars' (0)."""
  if text == "chars":
    return 0
  try:
    size = int(text)
  except ValueError:
    size = 0
  if size <= 257:
    raise argparse.ArgumentTypeError(
        f"--vocab takes a number of tokens above 257 (a byte-level BPE starts from 256 byte "
        f"tokens and an end-of-text token), or 'chars'; got {text!r}")
  return size


def fuse_length(text: str) -> int:
  """--fuse K: the longest fused segment, in blocks (at least 1)."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"takes a number of blocks, got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"takes a number of blocks >= 1, got {value}")
  return value


def parse(argv: list[str] | None) -> argparse.Namespace:
  """The flags, checked before anything is built or removed (argparse errors), and with
  --resume against the checkpoint's step and config."""
  parser = run_parser(DESCRIPTION, PRESETS)
  parser.add_argument("--check", action=argparse.BooleanOptionalAction,
                      help="also run the steps under one whole-step jax.jit, compare, and time "
                           "both in alternating rounds (default: on for the gpu presets)")
  parser.add_argument("--whole-step", action="store_true",
                      help="train through one whole-step jax.jit of the same layer functions "
                           "instead of the graphed layers: the same loop, keys, checkpoints "
                           "and tokens/s measurement, to compare with a graphed run")
  parser.add_argument("--rounds", type=int,
                      help="--check: timed rounds of each step (default: the preset's)")
  parser.add_argument("--round-steps", type=int,
                      help="steps per timed round, and untimed warm-up steps before the first "
                           "(default: the preset's)")
  parser.add_argument("--plain-ends", action="store_true",
                      help="embedding and head under plain jax.jit instead of graphed")
  parser.add_argument("--untied", action="store_true", help="a head matrix of its own")
  parser.add_argument("--dropout", type=float,
                      help="residual dropout rate in [0, 1) (default: the preset's)")
  parser.add_argument("--microbatches", type=int, help="per step (default: the preset's)")
  parser.add_argument("--batch", type=int,
                      help="sequences per microbatch (default: the preset's); with --fsdp N "
                           "split N ways, so N times a batch per device keeps that fixed")
  parser.add_argument("--flat", action=argparse.BooleanOptionalAction, default=True,
                      help="each part's params as flat buffers (jg.flat.ravel), one per "
                           "(decay group, dtype): fewer leaves per executable call (default; "
                           "--no-flat: pytrees)")
  parser.add_argument("--fuse", nargs="?", const=True, type=fuse_length, metavar="K",
                      help="replay the blocks as one forward and one backward executable per "
                           "microbatch (sequential_vjp(..., fuse=True)), or with K as "
                           "segments of at most K blocks (fuse=K: at most two compiles, a "
                           "K-block segment's and, when K does not divide the depth, the "
                           "remainder's; with --fsdp a block's all-gather can run under the "
                           "block before; with --pipeline each chunk's layers, 1f1b and "
                           "interleaved): fewer host calls, the same kernels; the fused "
                           "executables compile on the first step")
  parser.add_argument("--prefetch", action=argparse.BooleanOptionalAction,
                      help="with --fsdp: each block's forward also gathers the next block's "
                           "weights and its backward reduce-scatters the gradient of the block "
                           "above (sequential_vjp(..., prefetch=True)), so the collectives run "
                           "under the blocks' compute; each block's gathered weights are kept "
                           "for its backward; with --fuse K, each segment's forward gathers "
                           "the next segment's first block's weights (default: on GPUs; "
                           "--no-prefetch: each block gathers and reduces its own)")
  parser.add_argument("--residuals", choices=sorted(RESIDUAL_POLICIES), default="recompute",
                      help="what a graphed forward keeps for its backward: 'recompute' (default: "
                           "jaxgraph.residuals.recompute_elementwise, the whole step's device "
                           "time and a quarter of the memory), 'all' (every jax.vjp residual)")
  parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                      help="compute dtype (params are float32 either way)")
  parser.add_argument("--attention", choices=("xla", "cudnn"),
                      help="dot_product_attention implementation (default: the preset's)")
  parser.add_argument("--context", type=int,
                      help="tokens per sequence (default: the preset's); e.g. --preset gpu-1b "
                           "--context 8192 --batch 2")
  parser.add_argument("--text", choices=sorted(vocab_lib.TEXTS),
                      help="the training text: 'fables' (examples/data/corpus.txt) or 'stdlib' "
                           "(this Python's standard library sources); default: the preset's")
  parser.add_argument("--vocab", type=vocab_size, metavar="N|chars",
                      help="a byte-level BPE of N tokens trained on the text (once, cached in "
                           "--cache), or 'chars' for its characters (default: the preset's)")
  parser.add_argument("--cache", type=pathlib.Path, default=pathlib.Path("runs/cache"),
                      help="trained tokenizers and encoded texts, keyed by a digest of the "
                           "text and the vocabulary size (default: runs/cache)")
  parser.add_argument("--offload", type=offload_spec, default=OffloadSpec("none"),
                      metavar="none|all|slowdown=P%%|memory=SIZE",
                      help="keep the blocks' residuals in pinned host memory between forward "
                           "and backward (async copies), as jaxgraph.offload.plan picks from "
                           "the blocks' measured times and the measured link: 'all' moves "
                           "every kept buffer, 'slowdown=5%%' the most bytes predicted to cost "
                           "at most 5%% of the step, 'memory=4GiB' the fastest choice leaving "
                           "at most that much on the device per microbatch; prints the "
                           "measurement per block and the plan (default: none)")
  parser.add_argument("--init-from", type=pathlib.Path, metavar="RUN_DIR",
                      help="a new run starting from the params of the newest intact checkpoint "
                           "of the run in RUN_DIR (its --out; digests verified), written to its "
                           "own --out: fine-tuning, all params or with --lora adapters only "
                           "(a LoRA run's adapters merged into its kernels first). Pass that "
                           "run's --preset, --untied, --text, --vocab, --flat and --plain-ends")
  parser.add_argument("--lora", type=int, metavar="RANK",
                      help="with --init-from: LoRA, rank-RANK adapters on every block's "
                           "attention and MLP projections (A random, B zero: the start is the "
                           "loaded model), trained with AdamW; every other param frozen "
                           "(grad_mask) and bitwise unchanged")
  parser.add_argument("--generate", type=int, default=48,
                      help="tokens to generate at the end (at most half the context; 0: none)")
  parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/llama"))
  parser.add_argument("--seed", type=int, default=0, help="params, batches and dropout keys")
  parser.add_argument("--fsdp", type=int, metavar="N",
                      help="shard the params, grads and optimizer state over N devices "
                           "(jg.fsdp: every flat buffer split N ways, gathered once per "
                           "layer inside its executables) and split each batch over them; N "
                           "divides the batch; the first N devices of this process, or with "
                           "--coordinator every device of every process")
  parser.add_argument("--coordinator", metavar="HOST:PORT",
                      help="one process of a multi-process --fsdp run: "
                           "jax.distributed.initialize(HOST:PORT, --num-processes, "
                           "--process-id); every process runs the same command but its id")
  parser.add_argument("--num-processes", type=int, help="with --coordinator")
  parser.add_argument("--process-id", type=int, help="with --coordinator: 0, 1, ...")
  parser.add_argument("--pipeline", type=int, metavar="N",
                      help="pipeline parallelism: the blocks split into N contiguous stages, "
                           "one device each (the first N), the embedding with the first and "
                           "the head with the last, driven from this one Python thread by "
                           "jg.schedule.Pipeline over the --microbatches; each stage "
                           "updates its own params (docs/llama-options.md)")
  parser.add_argument("--schedule", choices=SCHEDULES,
                      help="with --pipeline: the stages' order: '1f1b' (default), "
                           "'interleaved' (2N chunks, chunk c on stage c %% N), 'zero-bubble' "
                           "(each backward split, weight gradients deferred)")
  parser.add_argument("--pipeline-threads", action="store_true",
                      help="with --pipeline: dispatch each stage's work from a thread of its "
                           "own (jg.schedule.Pipeline(..., threads=True)) instead of from this "
                           "one thread; the same results, bit for bit")
  args = parser.parse_args(argv)
  for name in ("steps", "stop_after", "microbatches", "batch", "rounds", "round_steps",
               "context"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} takes a number >= 1, got {getattr(args, name)}")
  for name in ("seed", "generate"):
    if getattr(args, name) < 0:
      parser.error(f"--{name} takes a number >= 0, got {getattr(args, name)}")
  if not args.temperature >= 0:
    parser.error(f"--temperature takes a number >= 0 (0: greedy), got {args.temperature}")
  if args.dropout is not None and not 0 <= args.dropout < 1:
    parser.error(f"--dropout takes a rate in [0, 1), got {args.dropout}")
  if args.whole_step and args.check:
    parser.error("--check compares the graphed step with the whole-step jax.jit; with "
                 "--whole-step there is no graphed step: drop one of them")
  if args.prefetch and args.fsdp is None:
    parser.error("--prefetch gathers the next block's FSDP shards: it needs --fsdp N")
  if args.whole_step and args.fuse:
    parser.error("--fuse replays the graphed blocks fused; with --whole-step there are no "
                 "graphed blocks: drop one of them")
  if args.offload.kind != "none":
    for flag, given in (("--whole-step", args.whole_step), ("--fuse", args.fuse),
                        ("--fsdp", args.fsdp is not None)):
      if given:
        parser.error(f"--offload plans the copies of each graphed block beside the next "
                     f"blocks' compute; {flag} {OFFLOAD_CONFLICTS[flag]}: drop one of them")
  if args.offload.kind == "slowdown" and not 0 <= args.offload.value < 10:
    parser.error(f"--offload slowdown= takes a fraction of the step in [0, 10) (e.g. 5%), got "
                 f"{args.offload.value}")
  preset_fields = PRESETS[args.preset]
  # The preset's value: the same run as without the flag (--resume compares).
  if args.batch == preset_fields.batch:
    args.batch = None
  if args.context == preset_fields.context:
    args.context = None
  if args.text == preset_fields.text:
    args.text = None
  if args.vocab is not None and (args.vocab or None) == preset_fields.vocab:
    args.vocab = None
  preset = resolve(args)
  if preset.attention == "cudnn" and args.dtype != "bfloat16":
    parser.error("cuDNN attention computes in bf16 or fp16: with --dtype float32 pass "
                 "--attention xla")
  check_steps(parser, args, preset.steps)
  check_fine_tuning(parser, args, preset)
  check_out(parser, args.out, resume=args.resume, fresh=args.fresh)
  # the pipeline's flags before --fsdp's devices: a flag it refuses is the message on any
  # machine (with --pipeline, --fsdp is refused, so no process group starts after)
  check_pipeline(parser, args, preset.depth)
  check_fsdp(parser, args, preset)
  if args.resume:
    check_resume(parser, args.out, run_config(args, preset), preset.steps,
                 min(preset.steps, args.stop_after or preset.steps), shown=shown_config,
                 finished=f"To train on from its params, start a new run from it: "
                          f"--init-from {args.out} and another --out",
                 legacy_metadata=args.legacy_metadata)
    check_vocabulary(parser, args.out, preset, args.cache,
                     legacy_metadata=args.legacy_metadata)
  return args

