"""Probes: scripts written to answer one question each, kept to answer it again
(benchmarks/README.md)."""
