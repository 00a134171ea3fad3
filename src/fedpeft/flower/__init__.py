"""Networked deployment on Flower: the same methods across real processes."""
