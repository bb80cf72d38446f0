"""Tests of aqtr.pax (Pax-style layers and selector injection)."""
