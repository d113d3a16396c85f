"""Inferflow: a configuration-driven inference engine for transformer models."""

__version__ = "0.1.0"
