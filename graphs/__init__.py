"""Capture and replay helpers for CUDA graphs, usable on any torch module."""

from . import nvtx

__all__ = ["nvtx"]
