"""The published shapes of Llama-shaped models, as Hugging Face configs and as this
project's TransformerConfig (through the family's converter), for benchmarks of random
weights: TinyLlama 1.1B, Qwen2.5-0.5B, Llama-3.2-1B and Llama-3.1-8B. Each comes with a
word-level tokenizer of its vocabulary's size (the converters need one; benchmarks feed
ids, not text) whose special tokens sit at the model's ids."""

from __future__ import annotations

import dataclasses
from typing import Any

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_TOKENS = {"bos_token": (128000, "<|begin_of_text|>"),
                  "eos_token": (128001, "<|end_of_text|>")}


@dataclasses.dataclass(frozen=True)
class Shape:
  title: str
  config_class: str                   # transformers' config and model: "Llama", "Qwen2"
  family: str                         # transformer_jax.convert's module and its Family
  fields: dict[str, Any]              # the config's
  tokens: dict[str, tuple[int, str]]  # {"eos_token": (id, piece)}
  template: str | None = None         # the tokenizer's post-processor: "<s> $A" adds BOS

  def hf_config(self) -> Any:
    import transformers
    return getattr(transformers, f"{self.config_class}Config")(**self.fields)

  def model_class(self) -> Any:
    import transformers
    return getattr(transformers, f"{self.config_class}ForCausalLM")

  def converter(self) -> Any:
    import importlib
    module, _, name = self.family.partition(":")
    return getattr(importlib.import_module(f"transformer_jax.convert.{module}"), name)

  def tokenizer(self) -> Any:
    from transformer_jax.data.hf_tokenizer import HFTokenizer
    specials = {i: piece for i, piece in self.tokens.values()}
    return HFTokenizer(word_level_tokenizer(self.fields["vocab_size"], specials,
                                            self.template),
                       {name: piece for name, (_, piece) in self.tokens.items()})

  def our_config(self, tokenizer: Any = None) -> Any:
    """This project's TransformerConfig of the shape, as the converter makes it."""
    config = self.hf_config()
    hf = {**config.to_dict(), "model_type": config.model_type}
    return self.converter().config_from_hf(hf, tokenizer or self.tokenizer(), self.title)


SHAPES = {
    # 22 layers, 2,048 wide, 32 heads and 4 key/value heads, SwiGLU 5,632, 32,000 tokens,
    # 2,048 positions, untied lm_head; <s> before each text.
    "tinyllama": Shape(
        "TinyLlama (1.1B)", "Llama", "llama:FAMILY",
        dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
             eos_token_id=2),
        {"unk_token": (0, "<unk>"), "bos_token": (1, "<s>"), "eos_token": (2, "</s>")},
        "<s> $A"),
    # 24 layers, 896 wide, 14 heads and 2 key/value heads, q/k/v biases, SwiGLU 4,864,
    # 151,936 tokens, 32,768 positions, rope_theta 1e6, tied lm_head; no BOS.
    "qwen2.5-0.5b": Shape(
        "Qwen2.5-0.5B", "Qwen2", "qwen:FAMILY_QWEN2",
        dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
             rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
             bos_token_id=151643, eos_token_id=151643),
        {"eos_token": (151643, "<|endoftext|>")}),
    # 16 layers, 2,048 wide, 32 heads of 64 and 8 key/value heads, SwiGLU 8,192, 128,256
    # tokens, 131,072 positions, "llama3" rope scaling, tied lm_head.
    "llama3.2-1b": Shape(
        "Llama-3.2-1B", "Llama", "llama:FAMILY",
        dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64,
             max_position_embeddings=131072, rms_norm_eps=1e-5,
             rope_parameters={**_LLAMA3_ROPE, "original_max_position_embeddings": 8192},
             tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001),
        _LLAMA3_TOKENS, "<|begin_of_text|> $A"),
    # 32 layers, 4,096 wide, 32 heads of 128 and 8 key/value heads, SwiGLU 14,336, 128,256
    # tokens, 131,072 positions, "llama3" rope scaling, untied lm_head.
    "llama3.1-8b": Shape(
        "Llama-3.1-8B", "Llama", "llama:FAMILY",
        dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             max_position_embeddings=131072, rms_norm_eps=1e-5,
             rope_parameters={**_LLAMA3_ROPE, "original_max_position_embeddings": 8192},
             tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
        _LLAMA3_TOKENS, "<|begin_of_text|> $A"),
}


def word_level_tokenizer(size: int, specials: dict[int, str], template: str | None = None) -> str:
  """tokenizer.json of a word-level tokenizer with `size` ids (`specials` at theirs)."""
  from tokenizers import Tokenizer, models, processors
  vocab = {specials.get(i, f"t{i}"): i for i in range(size)}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=specials.get(0, "t0")))
  tokenizer.add_special_tokens(list(specials.values()))
  if template:
    bos = template.split()[0]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(bos, vocab[bos])])
  return tokenizer.to_str()
