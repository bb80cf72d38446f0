"""Tests of aqtr.calibrations."""
