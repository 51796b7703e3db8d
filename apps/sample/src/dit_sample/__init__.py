"""dit-sample: Sample a trained DiT checkpoint and decode latents to images and video (Gradio UI and CLI)."""

__version__ = "0.1.0"
