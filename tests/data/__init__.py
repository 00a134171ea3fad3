"""Tests of ``fedpeft.data``."""
