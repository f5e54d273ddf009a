"""lightning_onebit: communication-compressed data-parallel training for Lightning."""

__version__ = "0.1.0"
