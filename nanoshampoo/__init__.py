"""nanoshampoo: optimizer research at speedrun pace: Shampoo, DistAdam, a GPT trainer, evidence."""

__version__ = "0.1.0"
