"""Tests of ``fedpeft.report``."""
