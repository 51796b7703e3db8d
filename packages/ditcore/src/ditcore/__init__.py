"""ditcore: diffusion transformers for images and video, from one CPU to many GPU nodes."""

__version__ = "0.1.0"
