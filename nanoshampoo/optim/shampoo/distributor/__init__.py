"""Distributors: who computes which block and how the results travel between ranks."""
