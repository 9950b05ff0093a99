# The examples and benchmarks run as modules from the repository root (`python -m
# examples.llama.train`, `python -m benchmarks.bench`); this rewrites the older commands
# (`PYTHONPATH=. python examples/llama/train.py`) in docs/*.md and docs/results/*.md:
#   sed -E -i -f docs-commands.sed docs/*.md docs/results/*.md
# Recorded outputs (docs/results/*.txt, *.json) keep the command as it was run.

# A command split after `PYTHONPATH=. \`: the variable goes, the continuation stays.
/PYTHONPATH=\. \\$/{
  N
  s/PYTHONPATH=\. \\\n([[:space:]]*python3? +(examples|benchmarks)\/)/\\\n\1/
}
# A command split after `python3`: the script on the next line.
/(^|[[:space:]])python3?[[:space:]]*$/{
  N
  s/(python3?)\n(examples|benchmarks)\/([A-Za-z0-9_]+)\/([A-Za-z0-9_]+)\.py([^A-Za-z0-9_]|$)/\1 -m\n\2.\3.\4\5/
  s/(python3?)\n(examples|benchmarks)\/([A-Za-z0-9_]+)\.py([^A-Za-z0-9_]|$)/\1 -m\n\2.\3\4/
}

# `python examples/llama/train.py` -> `python -m examples.llama.train` (two levels, then one).
s/(python3?) +(\.\/)?(examples|benchmarks)\/([A-Za-z0-9_]+)\/([A-Za-z0-9_]+)\.py([^A-Za-z0-9_]|$)/\1 -m \3.\4.\5\6/g
s/(python3?) +(\.\/)?(examples|benchmarks)\/([A-Za-z0-9_]+)\.py([^A-Za-z0-9_]|$)/\1 -m \3.\4\5/g
# `PYTHONPATH=.` before such a command (other variables between kept): -m finds the root.
s/PYTHONPATH=\. +(([A-Z_]+=[^ ]* +)*python3? -m (examples|benchmarks)\.)/\1/g
s/PYTHONPATH=\. +(python3? -m\n(examples|benchmarks)\.)/\1/

# docs/llama.md: the package's place on the path, and its NNX block's import of model.py.
s/^`examples\/llama\/` is a package \(`llama`\) of one module per concern; `train\.py` puts$/`examples\/llama\/` is a package (`examples.llama`) of one module per concern, beside/
s/^`examples\/` on the path \(where `common\.py` and `vocabulary\.py`, shared with `train_gpt\.py`,$/`examples\/common.py` and `examples\/vocabulary.py` (shared with `train_gpt.py`); it runs from/
s/^live\), so `python examples\/llama\/train\.py` runs from any directory\. To reuse a piece, put$/the repository root as `python -m examples.llama.train`. To reuse a piece, import it from/
s/^live\), so `python -m examples\.llama\.train` runs from any directory\. To reuse a piece, put$/the repository root as `python -m examples.llama.train`. To reuse a piece, import it from/
s/^`examples\/` on the path too: `from llama\.layers import split`\.$/the root: `from examples.llama.layers import split`./
/^import sys$/{
  N
  s/^import sys\nimport jax, jax\.numpy as jnp, optax$/import jax, jax.numpy as jnp, optax/
}
/^sys\.path\.insert\(0, "examples\/llama"\) +# from the repository's root$/d
s/^from model import Config, Llama( +)# examples\/llama\/model\.py: no jaxgraph in it$/from examples.llama.model import Config, Llama  # from the repository's root; no jaxgraph in it/

# docs/performance.md: how the scripts run.
s/^Every script runs from the repository root with `PYTHONPATH=\.`;$/Every script runs from the repository root as a module (`python -m benchmarks.NAME`);/
