"""Flax Linen building blocks of the Transformer."""
