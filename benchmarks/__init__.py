"""Benchmark scripts: each runs on the CPU with no arguments and prints one JSON object as its last line;
`python -m benchmarks.suite` runs them all against `goals.toml`."""
