"""Claim: int8 weights with no master copy need stochastic rounding."""
