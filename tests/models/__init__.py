"""Tests of ``fedpeft.models``."""
