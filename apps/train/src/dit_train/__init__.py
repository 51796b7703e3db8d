"""dit-train: Train a diffusion transformer with EDM or flow matching (Lightning Fabric + Megatron-Core parallelism)."""

__version__ = "0.1.0"
