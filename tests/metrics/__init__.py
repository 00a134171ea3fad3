"""Tests of ``fedpeft.metrics``."""
