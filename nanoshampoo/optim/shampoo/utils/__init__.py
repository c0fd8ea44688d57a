"""Shared foundation of the Shampoo optimizer.

Configs, state handling, shape tools, quantized state, load balancing and the parameter exchange.
"""
