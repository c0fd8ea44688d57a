"""nanoshampoo: an optimizer-research speedrun system (Distributed Shampoo, DistAdam, a GPT trainer, evidence tools)."""

__version__ = "0.1.0"
