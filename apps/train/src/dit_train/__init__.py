"""dit-train: Train a diffusion transformer with the EDM objective (Lightning Fabric + Megatron-Core parallelism)."""

__version__ = "0.1.0"
