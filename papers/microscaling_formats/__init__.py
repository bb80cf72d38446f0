"""Claim: block-scaled 4- and 8-bit formats vs per-channel int at equal bits."""
