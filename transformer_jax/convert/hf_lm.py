"""What the Hugging Face language models (hf_gpt2, hf_llama) share: a family's tables (its
config, tensor names and tokenizer files, `Family`), the tokenizer's ids in config.json, the
rows of their vocabulary in our ids, a state_dict read tensor by tensor, and the import and
the export themselves (`Family.read`, `Family.write`).

Their tokenizers are Hugging Face's (data/hf_tokenizer.py): our ids are theirs re-ordered
with PAD, BOS, EOS and UNK first, so every table over the vocabulary (the token embedding,
an untied lm_head) is re-laid on the way in and out, zero rows standing for the ids they
have no token for.

Generation as `generate()` does it: the import stops at every eos_token_id of config.json
and generation_config.json (Llama 3's three, Qwen's <|im_end|> and <|endoftext|>: the
tokenizer's eos_token is our EOS, the others `TransformerConfig.end_ids`), and decodes with
generation_config.json's do_sample, temperature, top_k and top_p (greedy where it does not
sample, as generate() is by default; transformers' defaults where it samples without
saying).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable

import numpy as np

from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, TransformerConfig
from transformer_jax.convert.files import Imported, OurModel, read_json, write_json
from transformer_jax.convert.hf import need_file, optional_json, read_weights, write_weights
from transformer_jax.convert.tensors import ConvertError, check_shape
from transformer_jax.data.hf_tokenizer import HFTokenizer
from transformer_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Family:
  """A family of Hugging Face language models, both ways."""
  name: str                 # the format: "hf_gpt2"
  title: str                # in messages: "GPT-2"
  layout: str               # what its directory holds, for a missing file's message
  read_tokenizer: Callable[[str], HFTokenizer]
  config_from_hf: Callable[[dict, HFTokenizer, str], TransformerConfig]
  state_to_params: Callable[[dict[str, np.ndarray], TransformerConfig, HFTokenizer, str], dict]
  incompatibility: Callable[[TransformerConfig, Any], "str | None"]
  hf_config: Callable[[TransformerConfig, HFTokenizer], dict]
  params_to_state: Callable[[dict, TransformerConfig, HFTokenizer], dict[str, np.ndarray]]

  def read(self, directory: str, allow_pickle: bool = False) -> Imported:
    """(config, params, run config, tokenizer, tokenizer) of a save_pretrained directory of
    the family."""
    hf = read_json(need_file(directory, "config.json", self.layout))
    try:
      tokenizer = self.read_tokenizer(directory)
    except ConvertError:
      raise
    except UserError as e:   # the tokenizer's files refused
      raise ConvertError(f"{directory}: {e}") from None
    cfg = self.config_from_hf(hf, tokenizer, os.path.join(directory, "config.json"))
    generation = optional_json(directory, "generation_config.json")
    cfg = cfg.replace(end_ids=end_ids(hf, generation, tokenizer))
    weights, state = read_weights(directory, allow_pickle)
    params = self.state_to_params(state, cfg, tokenizer, weights)
    # Room for a prompt as long as the continuation.
    decode = {**decode_defaults(generation), "max_new_tokens": min(200, cfg.max_len // 2)}
    run_config = {"task": "lm", "model": cfg.to_dict(), "decode": decode,
                  "converted_from": {"format": self.name, "path": os.path.abspath(directory)}}
    return cfg, params, run_config, tokenizer, tokenizer

  def write(self, model: OurModel, output: str) -> str:
    """Writes `model` as a save_pretrained directory of the family at `output` (absent or
    empty), which its model class and AutoTokenizer load; returns notes ("")."""
    cfg, tokenizer = model.config, model.record.assets.tokenizer
    problem = self.incompatibility(cfg, tokenizer)
    if problem:
      raise ConvertError(f"{model.path}: cannot export to {self.title}: {problem}")
    os.makedirs(output, exist_ok=True)
    write_weights(output, self.params_to_state(model.params, cfg, tokenizer))
    write_json(os.path.join(output, "config.json"), self.hf_config(cfg, tokenizer))
    write_json(os.path.join(output, "generation_config.json"),
               {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos_token_id(cfg, tokenizer)})
    tokenizer.write_hf_files(output, model_max_length=cfg.max_len)
    return ""


def check_vocabulary(hf: dict, tokenizer: HFTokenizer, source: str,
                     other_rows: bool = False) -> None:
  """config.json's vocab_size (unless `other_rows`: a family whose embedding may be padded
  past the tokenizer, as Qwen's is, or end before its last tokens, as Gemma 3 1B's does),
  and bos_token_id where the tokenizer adds one, must be the tokenizer's; its eos_token_id
  (one id or a list: the ids that end a text) must hold the tokenizer's eos_token, which
  ends the texts this project trains on."""
  rows = hf.get("vocab_size")
  if rows != tokenizer.size and not (other_rows and isinstance(rows, int) and rows > 0):
    raise ConvertError(f"{source}: vocab_size={rows}, but the tokenizer has "
                       f"{tokenizer.size} tokens")
  # A tokenizer that adds no BOS (Qwen's) never gives the model config.json's bos_token_id.
  if tokenizer.add_bos and hf.get("bos_token_id", tokenizer.bos_id) != tokenizer.bos_id:
    raise ConvertError(f"{source}: bos_token_id={hf['bos_token_id']!r} is not the "
                       f"tokenizer's bos_token ({tokenizer.bos_id}), the one token this "
                       "project starts texts with")
  ends = _ids(hf.get("eos_token_id", tokenizer.end_id))
  if tokenizer.end_id not in ends:
    raise ConvertError(f"{source}: eos_token_id={hf['eos_token_id']!r} does not hold the "
                       f"tokenizer's eos_token {tokenizer.eos_token!r} ({tokenizer.end_id}), "
                       "which ends the texts this project trains on")


def eos_token_id(cfg: TransformerConfig, tokenizer: HFTokenizer) -> int | list[int]:
  """config.json's and generation_config.json's eos_token_id of our model: the tokenizer's
  eos, or a list with the other end ids."""
  if not cfg.end_ids:
    return tokenizer.end_id
  return [tokenizer.end_id, *tokenizer.to_theirs(list(cfg.end_ids)).tolist()]


def _ids(value: Any) -> list[int]:
  """An eos_token_id field (one id, a list, or null) as a list."""
  return [] if value is None else [value] if isinstance(value, int) else list(value)


def end_ids(hf: dict, generation: dict, tokenizer: HFTokenizer) -> tuple[int, ...]:
  """Our ids, besides EOS, of the eos_token_ids of config.json and generation_config.json
  (the tokens generate() stops at)."""
  theirs = set(_ids(hf.get("eos_token_id"))) | set(_ids(generation.get("eos_token_id")))
  if any(not 0 <= i < tokenizer.size for i in theirs):
    raise ConvertError(f"eos_token_id {sorted(theirs)}: ids past the tokenizer's "
                       f"{tokenizer.size} tokens")
  ours = {int(i) for i in tokenizer.to_ours(sorted(theirs))} - {EOS_ID}
  return tuple(sorted(ours))


def decode_defaults(generation: dict) -> dict[str, Any]:
  """Our decode options of generation_config.json, as generate() reads it: greedy unless
  do_sample; sampling with its temperature, top_k and top_p (transformers' defaults 1.0,
  50 and 1.0 where it gives none)."""
  if not generation.get("do_sample"):
    return {"temperature": 0.0}
  return {"temperature": float(generation.get("temperature") or 1.0),
          "top_k": int(50 if generation.get("top_k") is None else generation["top_k"]),
          "top_p": float(1.0 if generation.get("top_p") is None else generation["top_p"])}


def rows_to_ours(theirs: np.ndarray, tokenizer: HFTokenizer) -> np.ndarray:
  """Their (rows, D) table (token embeddings, an lm_head) in our ids: zero rows for the ids
  they have no token for, or their tokens past the table's rows (never read, never
  scored); rows past the tokenizer's tokens (a padded table) are dropped."""
  table = np.zeros((tokenizer.vocab_size, theirs.shape[1]), np.float32)
  kept = min(len(theirs), tokenizer.size)
  table[tokenizer.to_ours(np.arange(kept))] = theirs[:kept]
  return table


def rows_to_theirs(ours: np.ndarray, tokenizer: HFTokenizer, rows: int | None = None
                   ) -> np.ndarray:
  """Our (vocab, D) rows in their ids, their first `rows` (default: every token's)."""
  return ours[tokenizer.to_ours(np.arange(tokenizer.size if rows is None else rows))]


def rowless_ids(rows: int, tokenizer: HFTokenizer) -> tuple[int, ...]:
  """Our ids of the tokenizer's tokens past a checkpoint's `rows` embedding rows."""
  return tuple(int(i) for i in tokenizer.to_ours(np.arange(rows, tokenizer.size)))


def table_rows(cfg: TransformerConfig, tokenizer: HFTokenizer) -> int:
  """How many rows the exported tables have: the tokenizer's tokens, less those past the
  imported checkpoint's rows (absent ids beyond PAD, BOS and UNK; the last of theirs)."""
  return tokenizer.size - len(set(cfg.absent_ids) - {PAD_ID, BOS_ID, UNK_ID})


class StateDict:
  """A state_dict (`prefix`, the model class's, removed from its keys) read tensor by
  tensor: `take` checks a tensor's shape, `check_all_taken` names one left over (an option
  this project lacks). Keys matching `skipped` (buffers older files keep) are ignored."""

  def __init__(self, state: dict[str, np.ndarray], source: str, prefix: str,
               skipped: str = r"^$"):
    self.state = {k.removeprefix(prefix): v for k, v in state.items()}
    self.source, self._skipped = source, re.compile(skipped)
    self._taken: set[str] = set()

  def __contains__(self, key: str) -> bool:
    return key in self.state

  def rows(self, key: str) -> int:
    """The first dimension of tensor `key` (a table's rows)."""
    if key not in self.state:
      raise ConvertError(f"{self.source}: missing tensor {key}")
    return int(self.state[key].shape[0])

  def take(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
    if key not in self.state:
      raise ConvertError(f"{self.source}: missing tensor {key}")
    check_shape(key, self.state[key], shape, self.source)
    self._taken.add(key)
    return self.state[key]

  def check_all_taken(self) -> None:
    left = sorted(k for k in set(self.state) - self._taken if not self._skipped.search(k))
    if left:
      raise ConvertError(f"{self.source}: unexpected tensor {left[0]} ({len(left)} in all): "
                         "an option this project lacks")

  def tied_output(self, key: str, embedding_key: str, why: str) -> None:
    """A tied model's output `key`, where the file keeps one: it must be `embedding_key`."""
    if key in self.state:
      embedding = self.state[embedding_key]
      if not np.array_equal(self.take(key, embedding.shape), embedding):
        raise ConvertError(f"{self.source}: {key} differs from {embedding_key}: {why}")


def tokenizer_problem(cfg: TransformerConfig, tokenizer: Any, expected: type[HFTokenizer],
                      what: str) -> str | None:
  """Why `tokenizer` cannot be the exported model's (`expected`, named `what`), or None.
  Its absent ids must be the model's: the output scores them NO_TOKEN_LOGIT."""
  if not isinstance(tokenizer, expected):
    return (f"tokenizer kind {getattr(tokenizer, 'kind', None)!r}: {what} (an import's "
            "tokenizer)")
  specials = {PAD_ID, BOS_ID, UNK_ID}
  if (cfg.bos_is_eos, set(cfg.no_token_ids) & specials) != (
      tokenizer.bos_is_eos, set(tokenizer.absent_ids) | (specials if tokenizer.bos_is_eos
                                                         else set())):
    return (f"model.bos_is_eos={cfg.bos_is_eos} and model.absent_ids={cfg.absent_ids}, "
            f"but the tokenizer has bos_is_eos={tokenizer.bos_is_eos} and absent ids "
            f"{tokenizer.absent_ids}")
  return None
