"""Hugging Face Gemma 3's text model (`Gemma3ForCausalLM`, model_type "gemma3_text": Gemma
3 270M and 1B, and the text layers of the larger ones) in and out: Llama's shape (llama.py)
with
- RMSNorm scaled by 1 + w (`norm_type="rms_plus_one"`), four norms a layer
  (`sandwich_norm`) and one on each head's query and key (`qk_norm`);
- token embeddings scaled by sqrt(hidden_size) (`scale_embeddings`), tied to the output;
- a GELU (tanh) gated feed-forward (`hidden_activation`);
- scores scaled by query_pre_attn_scalar^-0.5 (`attention_scale`) and an explicit head_dim;
- sliding and full layers alternating (`layer_types`, or older files'
  `sliding_window_pattern`: every sixth layer full), the sliding ones with a rotary base of
  their own, unscaled (`local_rope_theta`: `rope_local_base_freq`, or rope_parameters'
  "sliding_attention"), the full ones scaled as rope_parameters' "full_attention" says.
"""

from __future__ import annotations

from typing import Any

from transformer_jax.config import TransformerConfig
from transformer_jax.convert.llama import (
  LLAMA_SHAPE,
  Shape,
  family,
  hf_layer_types,
  hf_rope,
  rope_fields,
  rope_of,
  window_fields,
)
from transformer_jax.convert.tensors import ConvertError

_GEMMA = {"norm_type": "rms_plus_one", "sandwich_norm": True, "qk_norm": True,
          "scale_embeddings": True}
_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0   # Gemma3TextConfig's defaults


def _options(hf: dict, source: str) -> dict[str, Any]:
  pattern = hf.get("sliding_window_pattern", 6)
  fields = window_fields(hf, lambda layer: bool((layer + 1) % pattern), source)
  fields.update(rope_of({"rope_theta": _GLOBAL_THETA, **hf}, source, "full_attention"))
  local = (hf.get("rope_parameters") or {}).get("sliding_attention")
  if local is None:
    fields["local_rope_theta"] = float(hf.get("rope_local_base_freq", _LOCAL_THETA))
  else:
    rope = rope_fields(local, "rope_parameters.sliding_attention", source)
    if set(rope) - {"rope_theta"}:
      raise ConvertError(f"{source}: rope_parameters.sliding_attention is scaled: an option "
                         "this project lacks (its sliding layers' rotary positions are not)")
    fields["local_rope_theta"] = rope.get("rope_theta", _LOCAL_THETA)
  fields["attention_scale"] = float(hf.get("query_pre_attn_scalar", 256)) ** -0.5
  return fields


def _hf_options(cfg: TransformerConfig) -> dict[str, Any]:
  scalar = (cfg.attention_scale or cfg.head_dim ** -0.5) ** -2
  return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar":
          round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
          "sliding_window": cfg.sliding_window or None, "layer_types": hf_layer_types(cfg),
          "rope_parameters": {"full_attention": hf_rope(cfg), "sliding_attention": {
              "rope_type": "default", "rope_theta": cfg.local_rope_theta or cfg.rope_theta}},
          "final_logit_softcapping": None, "attn_logit_softcapping": None}


GEMMA3 = Shape("gemma3_text", "Gemma3ForCausalLM", "Gemma 3",
               tuple((field, _GEMMA.get(field, value)) for field, value in LLAMA_SHAPE
                     if field not in ("attention_scale", "layer_types", "local_rope_theta")),
               must_be={"attention_bias": False}, options=_options, hf_options=_hf_options,
               # Gemma3TextConfig's own, which Gemma 3's published files leave out.
               defaults={"tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
                         "head_dim": 256, "rms_norm_eps": 1e-6, "sliding_window": 4096,
                         "max_position_embeddings": 131072})
FAMILY = family(GEMMA3)
