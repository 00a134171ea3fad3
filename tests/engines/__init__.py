"""Tests of ``fedpeft.engines``."""
