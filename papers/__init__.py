"""Small-scale reproductions of published quantization claims (see README)."""
