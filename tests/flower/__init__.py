"""Tests of ``fedpeft.flower``."""
