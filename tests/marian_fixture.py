"""A small random MarianMTModel with its MarianTokenizer files, written with save_pretrained,
offline (SentencePiece models trained on Multi30k text): the source model of the convert tests."""

from __future__ import annotations

import gzip
import io
import json
import os

import sentencepiece as spm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "..", "shared", "data", "multi30k")


def lines(name: str, limit: int | None = None) -> list[str]:
  with gzip.open(os.path.join(DATA, name), "rt", encoding="utf-8") as f:
    found = [line.rstrip("\n") for line in f]
  return found[:limit] if limit else found


def _spm(texts: list[str], size: int) -> bytes:
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model,
                                 vocab_size=size, hard_vocab_limit=False, minloglevel=2,
                                 num_threads=1)
  return model.getvalue()


def write_marian_dir(directory: str) -> None:
  """A random MarianMTModel (OPUS-MT layout: swish, scaled embeddings, pad = decoder start =
  last id, EOS 0, UNK 1) and its MarianTokenizer files, saved with save_pretrained."""
  import torch
  import transformers
  protos = {"source.spm": _spm(lines("train.de.gz", 3000), 300),
            "target.spm": _spm(lines("train.en.gz", 3000), 300)}
  pieces = []
  for name, proto in protos.items():
    with open(os.path.join(directory, name), "wb") as f:
      f.write(proto)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    pieces += [sp.id_to_piece(i) for i in range(sp.get_piece_size())
               if not (sp.is_control(i) or sp.is_unknown(i))]
  words = ["</s>", "<unk>"] + list(dict.fromkeys(pieces)) + ["<pad>"]
  with open(os.path.join(directory, "vocab.json"), "w") as f:
    json.dump({w: i for i, w in enumerate(words)}, f)
  pad = len(words) - 1
  hf = transformers.MarianConfig(
      vocab_size=len(words), d_model=32, encoder_layers=2, decoder_layers=2,
      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
      decoder_ffn_dim=64, max_position_embeddings=128, activation_function="swish",
      scale_embedding=True, pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0,
      forced_eos_token_id=None, dropout=0.1)
  torch.manual_seed(0)
  model = transformers.MarianMTModel(hf).eval()
  with torch.no_grad():   # every tensor random, LayerNorms and the logits bias included
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if "layer_norm.weight" in name
              else 0.3 * torch.randn_like(p))
    model.final_logits_bias.copy_(torch.randn_like(model.final_logits_bias))
  model.generation_config.max_length = 32    # the import's decoding budget (predict)
  model.save_pretrained(directory)
  tokenizer = transformers.MarianTokenizer(os.path.join(directory, "source.spm"),
                                           os.path.join(directory, "target.spm"),
                                           os.path.join(directory, "vocab.json"))
  tokenizer.save_pretrained(directory)
