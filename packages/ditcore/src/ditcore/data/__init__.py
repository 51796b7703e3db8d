"""Datasets of precomputed latents and text embeddings: on-disk schema, writing, Energon loading and packing."""
