"""kvoffload: hybrid-aware KV-cache offloading for LLM inference engines."""

__version__ = "0.1.0"
