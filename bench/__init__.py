"""Benchmarks and node emulation that drive flexgen_dist's CLI/API as a user would; not part of the installed package."""
