"""Numeric helpers shared by the tests, the benchmarks and the lint."""

from jetrl.testing.numerics import has_sm90, max_abs_diff, sqnr_db

__all__ = ["sqnr_db", "max_abs_diff", "has_sm90"]
