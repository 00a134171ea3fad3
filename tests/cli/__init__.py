"""Tests of the ``fedpeft`` command line (``fedpeft.cli``)."""
