"""Claim: the MSE-optimal clip makes 2- to 4-bit quantization work."""
