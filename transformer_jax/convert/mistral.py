"""Hugging Face Mistral (`MistralForCausalLM`) in and out: Llama's shape (llama.py) with a
sliding window over every layer (`sliding_window`: Mistral 7B v0.1's 4,096 keys; v0.2 and
later have none, and an explicit `head_dim` where it is not hidden_size / heads)."""

from __future__ import annotations

from typing import Any

from transformer_jax.config import TransformerConfig
from transformer_jax.convert.llama import LLAMA_SHAPE, Shape, family, window_fields


def _options(hf: dict, source: str) -> dict[str, Any]:
  return window_fields(hf, lambda layer: True, source)


def _hf_options(cfg: TransformerConfig) -> dict[str, Any]:
  return {"sliding_window": cfg.sliding_window or None}


MISTRAL = Shape("mistral", "MistralForCausalLM", "Mistral", LLAMA_SHAPE,
                must_be={"attention_bias": False}, options=_options, hf_options=_hf_options)
FAMILY = family(MISTRAL)
