"""``python -m fedpeft``: the ``fedpeft`` command (what torch's launcher starts in each rank)."""

from fedpeft.cli import app

app()
