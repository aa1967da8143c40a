"""Evaluation (paper Section 5): benchmarks decoded, accepted length and its intervals, reports, figures."""
