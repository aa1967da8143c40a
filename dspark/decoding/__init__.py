"""Speculative decoding (paper Section 2): sampling, verification by rejection sampling, the draft/verify/accept loop."""
