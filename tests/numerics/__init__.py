"""Tests of aqtr.numerics."""
