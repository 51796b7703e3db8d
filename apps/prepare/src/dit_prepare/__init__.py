"""dit-prepare: Turn images/videos + captions into an Energon dataset of precomputed latents and text embeddings."""

__version__ = "0.1.0"
