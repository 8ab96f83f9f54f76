"""Benchmarks of minillm against peers, run on a GPU by `python -m bench.run` (see bench/run.py)."""
