"""Backends and ``torch.library`` ops behind :mod:`moe_grouped.permute`."""
