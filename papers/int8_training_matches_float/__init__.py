"""Claim: int8 forward and backward training matches float (AQT)."""
