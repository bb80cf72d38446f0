"""Tests of aqtr.freezers."""
