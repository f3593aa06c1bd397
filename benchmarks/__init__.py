"""Measurements of lightning-otel (results and how each was run: RESULTS.md). Nothing here is the product:
what a benchmark needs beyond measuring lives in the package, and the tests import no benchmark.

Run a script as a module from the repository root, e.g. `.venv/bin/python -m benchmarks.ingest_throughput
--spans 1000000`, so that it imports its siblings as `benchmarks.<name>` (a script that imports none also runs
as a file, as its docstring shows). Learning runs are in benchmarks/learning/, peers (other projects measured
the same way) in benchmarks/peers/, and the scripts' own tests in test_scripts.py.
"""
