"""Hugging Face Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`) and Qwen3 (`Qwen3ForCausalLM`) in and
out: Llama's shape (llama.py) with
- Qwen2: biases on the query, key and value projections (`qkv_bias`);
- Qwen3: no biases, an RMSNorm on each head's query and key (`qk_norm`) and an explicit
  `head_dim`.
Both may slide a window over their upper layers (`use_sliding_window`: layers from
`max_window_layers` on), which no released checkpoint turns on."""

from __future__ import annotations

from typing import Any

from transformer_jax.config import TransformerConfig
from transformer_jax.convert.llama import (
  LLAMA_SHAPE,
  Shape,
  family,
  hf_layer_types,
  window_fields,
)


def _options(hf: dict, source: str) -> dict[str, Any]:
  first = hf.get("max_window_layers", hf["num_hidden_layers"])
  if not hf.get("use_sliding_window") and not hf.get("layer_types"):
    return {}
  return window_fields(hf, lambda layer: layer >= first, source)


def _hf_options(cfg: TransformerConfig) -> dict[str, Any]:
  sliding = [cfg.layer_sliding(i) for i in range(cfg.num_decoder_layers)]
  return {"use_sliding_window": any(sliding), "sliding_window": cfg.sliding_window or None,
          "max_window_layers": sliding.index(True) if any(sliding) else len(sliding),
          "layer_types": hf_layer_types(cfg)}


def _with(**changes: Any) -> tuple[tuple[str, Any], ...]:
  """Llama's shape with `changes`, and any layer types (Qwen's windows may cover only the
  upper layers)."""
  return tuple((field, changes.get(field, value)) for field, value in LLAMA_SHAPE
               if field != "layer_types")


QWEN2 = Shape("qwen2", "Qwen2ForCausalLM", "Qwen2", _with(qkv_bias=True),
              options=_options, hf_options=_hf_options)
QWEN3 = Shape("qwen3", "Qwen3ForCausalLM", "Qwen3", _with(qk_norm=True),
              must_be={"attention_bias": False}, options=_options, hf_options=_hf_options)
FAMILY_QWEN2, FAMILY_QWEN3 = family(QWEN2), family(QWEN3)
