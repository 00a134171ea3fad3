"""Runnable experiment configs shipped with fedpeft (``fedpeft run`` with no argument uses default.yaml)."""
