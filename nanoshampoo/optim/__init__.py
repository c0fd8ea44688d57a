"""Optimizers: Distributed Shampoo (`nanoshampoo.optim.shampoo`) and sharded Adam
(`nanoshampoo.optim.dist_adam`)."""
