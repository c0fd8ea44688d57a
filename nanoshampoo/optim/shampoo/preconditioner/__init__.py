"""Preconditioners: the math of one preconditioner per module."""
