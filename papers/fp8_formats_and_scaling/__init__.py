"""Claim: e4m3 forward + e5m2 gradients train like float (HFP8, FP8-LM)."""
