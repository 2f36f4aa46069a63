"""flowrl: reinforcement-learning alignment of diffusion and flow generative models."""

__version__ = "0.1.0"
