"""Data: FineWeb-style token shards, loaders, corpus preparation."""
