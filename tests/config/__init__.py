"""Tests of ``fedpeft.config``."""
