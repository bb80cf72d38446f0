"""Tests of aqtr.tilings."""
