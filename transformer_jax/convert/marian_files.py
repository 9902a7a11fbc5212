"""A MarianMT save_pretrained directory in and out (config.json, model.safetensors,
generation_config.json, source.spm, target.spm, vocab.json, tokenizer_config.json), as
`MarianMTModel` and `MarianTokenizer` read and write it. The names and ids are `marian`'s;
the weights files and JSON are read as for every Hugging Face format (`hf`).
"""

from __future__ import annotations

import os

import numpy as np

from transformer_jax.config import BOS_ID
from transformer_jax.convert import marian
from transformer_jax.convert.files import Imported, OurModel, read_json, write_json
from transformer_jax.convert.hf import need_file, optional_json, read_weights, write_weights
from transformer_jax.convert.tensors import ConvertError
from transformer_jax.data.tokenizer import MarianSentencePiece
from transformer_jax.options import DecodeOptions
from transformer_jax.renamed_fields import upgrade


def _need(directory: str, name: str) -> str:
  return need_file(directory, name, "a MarianMT save_pretrained directory has config.json, "
                   "model.safetensors, source.spm, target.spm, vocab.json")


def import_marian(directory: str, allow_pickle: bool = False) -> Imported:
  """(config, params, run config, source tokenizer, target tokenizer) of a MarianMT
  save_pretrained directory."""
  if not os.path.isdir(directory):
    raise ConvertError(f"--input={directory}: no such directory")
  hf = read_json(_need(directory, "config.json"))
  cfg = marian.config_from_hf(hf, os.path.join(directory, "config.json"))
  vocab = read_json(_need(directory, "vocab.json"))
  tok_config = optional_json(directory, "tokenizer_config.json")
  if tok_config.get("separate_vocabs"):
    raise ConvertError(f"{directory}/tokenizer_config.json: separate_vocabs=true does not "
                       "convert (one vocabulary is shared by source and target here)")
  order, size = marian.id_order(hf, vocab, tok_config, directory)
  if len(vocab) != size or sorted(vocab.values()) != list(range(size)):
    raise ConvertError(f"{directory}/vocab.json: {len(vocab)} entries, but config.json has "
                       f"vocab_size={size} (ids must be 0..{size - 1}, each once)")

  weights, state = read_weights(directory, allow_pickle)
  params = marian.state_to_params(state, cfg, order, weights, hf.get(marian.MARKER))
  if "zero_decoder_start" not in hf.get(marian.MARKER, {}):
    # OPUS-MT's decoder start row (<pad>, our BOS) is zero, as Marian starts its decoders;
    # keeping it zero through fine-tuning keeps CTranslate2 translating as we do. A model
    # whose row is not zero is imported as transformers computes it.
    start_row = params["shared_embedding"]["embedding"][BOS_ID]
    cfg = cfg.replace(zero_decoder_start=not np.any(start_row))

  pieces_by_id = {i: piece for piece, i in vocab.items()}
  if marian.JAX_PAD_PIECE in vocab and order[0] is None:
    raise ConvertError(f"{directory}/vocab.json: {marian.JAX_PAD_PIECE} is reserved for the "
                       "PAD row")
  pieces = [marian.JAX_PAD_PIECE if i is None else pieces_by_id[i] for i in order]
  with open(_need(directory, "source.spm"), "rb") as f:
    source = MarianSentencePiece(f.read(), pieces, append_eos=True)
  with open(_need(directory, "target.spm"), "rb") as f:
    target = MarianSentencePiece(f.read(), pieces, append_eos=False)

  generation = optional_json(directory, "generation_config.json")
  max_length = min(int(generation.get("max_length") or cfg.max_len), cfg.max_len)
  run_config = {"task": "seq2seq", "model": cfg.to_dict(),
                "decode": {"beam_size": int(generation.get("num_beams") or 4), "alpha": 0.6,
                           # predict allows the batch's target width + this:
                           # at least HF's max_length.
                           "max_extra_length": max_length - 1},
                "converted_from": {"format": "hf_marian", "path": os.path.abspath(directory)}}
  return cfg, params, run_config, source, target


def write_hf_marian(model: OurModel, output: str) -> str:
  """Writes `model` as a MarianMT save_pretrained directory at `output` (which must be
  absent or empty); returns notes for the user ("" when every reader computes it exactly)."""
  if os.path.exists(output) and os.listdir(output):
    raise ConvertError(f"--output={output} exists and is not empty; choose another")
  cfg = model.config
  tokenizer, target = model.record.assets.tokenizer, model.record.assets.target_tokenizer
  problem = marian.incompatibility(cfg, tokenizer, target)
  if problem:
    raise ConvertError(f"{model.path}: cannot export to MarianMT: {problem}")
  os.makedirs(output, exist_ok=True)
  state, pad_row = marian.params_to_state(model.params, cfg)
  write_weights(output, state)
  beam_size = DecodeOptions.from_dict(upgrade(model.record.config).get("decode")).beam_size
  files = {"config.json": marian.hf_config(cfg, pad_row),
           "generation_config.json": marian.generation_config(cfg, beam_size),
           "vocab.json": marian.vocab(tokenizer, marian.opus_mt_order(cfg)),
           "tokenizer_config.json": marian.tokenizer_config(cfg)}
  for name, content in files.items():
    write_json(os.path.join(output, name), content)
  for name, side in (("source.spm", tokenizer), ("target.spm", target)):
    with open(os.path.join(output, name), "wb") as f:
      f.write(side.model_proto)
  notes = []
  if cfg.layer_norm_epsilon != marian.MARIAN_EPSILON:
    notes.append(f"note: layer_norm_epsilon={cfg.layer_norm_epsilon:g} becomes MarianMT's "
                 f"fixed {marian.MARIAN_EPSILON:g} in transformers (recorded in config.json "
                 "for the way back)")
  if np.any(state["model.shared.weight"][-1]):
    notes.append("note: the decoder's start embedding (<pad>, our BOS) is not zero: "
                 "transformers computes this model exactly, but CTranslate2 starts Marian "
                 "decoders from a zero vector, so its translations can differ from ours; "
                 "train with --config.model.zero_decoder_start=True to deploy there")
  return "\n".join(notes)
