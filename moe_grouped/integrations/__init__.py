"""Adapters that plug moe_grouped into other libraries.

Each submodule imports its library lazily (at first use), so importing
``moe_grouped`` never needs them:

- :mod:`moe_grouped.integrations.transformers`: an experts implementation for
  Hugging Face transformers 5.x MoE models (``pip install
  "moe_grouped[transformers]"``).
"""
