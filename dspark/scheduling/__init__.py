"""Verification scheduling (paper Section 3.2): STS calibration, Algorithm 1 and its variants, SPS tables, policies, the serving simulator."""
