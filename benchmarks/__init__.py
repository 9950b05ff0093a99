"""jaxgraph's benchmarks (here) and probes (`probes/`): benchmarks/README.md says which
answers what. Run them from the repository root with `PYTHONPATH=.`; they import each other
as `benchmarks.<name>` and `benchmarks.probes.<name>`."""
