"""retouch: a serving engine for generative image editing with diffusion models."""

__version__ = "0.1.0"
