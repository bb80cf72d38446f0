"""Claim: at equal bytes, 4-bit beats 8-bit and bf16 (Abdolrashidi 2021)."""
