"""Helpers shared by test modules, in one place (fixtures stay in ``tests/conftest.py``):

- ``configs``: the tiny experiment, shared method settings, the tasks' configs;
- ``cohort``: a cohort's round against its clients' rounds alone;
- ``flower``: an in-memory Flower grid and a fake federation on it;
- ``runs``: runs killed on purpose, resumed, compared.
"""
