"""GPT-2's byte-level BPE (Radford et al., 2019): a Hugging Face tokenizer (hf_tokenizer.py)
whose one special token, <|endoftext|>, ends a text and starts the next. It is our EOS; a
model with this tokenizer sets `bos_is_eos`, so BOS reads the same embedding row, and PAD,
BOS and UNK (which GPT-2 lacks: any text encodes without unknown tokens) are ids without a
token. Every other id keeps its order:

  ours    PAD 0   BOS 1   EOS 2           UNK 3   4, 5, ..., V + 2
  GPT-2   -       -       <|endoftext|>   -       0, 1, ..., V - 1 but <|endoftext|>

(V = 50,257 for GPT-2, whose <|endoftext|> is its last id, 50,256: ours = GPT-2's + 4.)
GPT2Tokenizer adds no special token to a text, so a prompt starts without BOS.
"""

from __future__ import annotations

import json
from typing import Any

from transformer_jax.data.hf_tokenizer import HFTokenizer, tokenizers_package

END_OF_TEXT = "<|endoftext|>"


class ByteLevelBPE(HFTokenizer):
  """GPT-2's tokenizer (`tokenizer_json`: Hugging Face's tokenizer.json) in our ids, with
  GPT2Tokenizer's tokenizer_config.json."""

  kind = "byte_bpe"

  def __init__(self, tokenizer_json: str, end_token: str = END_OF_TEXT):
    super().__init__(tokenizer_json, {
        "tokenizer_class": "GPT2Tokenizer", "bos_token": end_token, "eos_token": end_token,
        "unk_token": end_token, "add_bos_token": False})

  @property
  def end_token(self) -> str:
    assert self.eos_token is not None   # HFTokenizer refuses a tokenizer without one
    return self.eos_token

  @classmethod
  def from_files(cls, vocab_file: str, merges_file: str, add_prefix_space: bool = False,
                 end_token: str = END_OF_TEXT) -> "ByteLevelBPE":
    """From vocab.json and merges.txt, built as GPT2Tokenizer builds them."""
    tk = tokenizers_package()
    bpe = tk.models.BPE.from_file(vocab_file, merges_file, dropout=None,
                                  continuing_subword_prefix="", end_of_word_suffix="",
                                  fuse_unk=False)
    tokenizer = tk.Tokenizer(bpe)
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tokenizer.decoder = tk.decoders.ByteLevel()
    tokenizer.add_special_tokens([end_token])
    return cls(tokenizer.to_str(), end_token)

  # ------------------------------------------------------------------------ files
  @classmethod
  def load(cls, path: str) -> "ByteLevelBPE":
    """What `save` wrote (HFTokenizer's file), or an older file naming only its end_token."""
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
    return cls(data["tokenizer_json"], data.get("end_token") or data["config"]["eos_token"])

  def write_hf_files(self, directory: str, **config: Any) -> None:
    """tokenizer.json and tokenizer_config.json, and the BPE's vocab.json and merges.txt,
    as GPT2Tokenizer saves them (in GPT-2's ids)."""
    super().write_hf_files(directory, **config)
    self._tokenizer.model.save(directory)
