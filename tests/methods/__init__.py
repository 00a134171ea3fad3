"""Tests of ``fedpeft.methods``."""
