"""Shared foundation of the Shampoo optimizer: configs, state handling, shape tools, communication helpers."""
