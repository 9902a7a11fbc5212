"""transformer_jax: the Transformer of "Attention Is All You Need" in JAX and Flax.

The Flax-backed names (the models, count_params) are imported on first use (PEP 562), so
that importing a submodule such as `transformer_jax.serving` does not import Flax: a served
model needs only jax, numpy and sentencepiece.
"""

import importlib
from typing import Any

from transformer_jax.platforms import skip_missing_tpu

skip_missing_tpu()   # before anything starts a JAX backend

from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, TransformerConfig  # noqa: E402
from transformer_jax.inputs import InputError, check_inputs, check_token_ids  # noqa: E402

_LAZY = {
    "Transformer": "transformer_jax.modules.models",
    "Encoder": "transformer_jax.modules.models",
    "Decoder": "transformer_jax.modules.models",
    "LanguageModel": "transformer_jax.modules.models",
    "EncoderClassifier": "transformer_jax.modules.heads",
    "TokenClassifier": "transformer_jax.modules.heads",
    "count_params": "transformer_jax.params",
}


def __getattr__(name: str) -> Any:
  if name in _LAZY:
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value   # Later lookups skip this function.
    return value
  raise AttributeError(f"module 'transformer_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "TransformerConfig", "Transformer", "Encoder", "Decoder", "LanguageModel", "EncoderClassifier",
    "TokenClassifier", "InputError", "check_inputs", "check_token_ids", "count_params",
    "PAD_ID", "BOS_ID", "EOS_ID", "UNK_ID",
]
__version__ = "0.1.0"
