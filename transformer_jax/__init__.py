"""transformer_jax: the Transformer of "Attention Is All You Need" in JAX and Flax."""

from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, TransformerConfig
from transformer_jax.inputs import InputError, check_inputs, check_token_ids
from transformer_jax.modules.models import (Decoder, Encoder, EncoderClassifier,
                                            TokenClassifier, Transformer)
from transformer_jax.params import count_params

__all__ = [
    "TransformerConfig", "Transformer", "Encoder", "Decoder", "EncoderClassifier",
    "TokenClassifier", "InputError", "check_inputs", "check_token_ids", "count_params",
    "PAD_ID", "BOS_ID", "EOS_ID", "UNK_ID",
]
__version__ = "0.1.0"
