"""What the Hugging Face formats (hf_marian, hf_gpt2, hf_llama) share: activation names, the
files of a save_pretrained directory (weights, one file or shards, optional JSON), and the
Hub, where --input may name a model instead of a directory.

The weights are read with `safetensors` (no torch needed); `pytorch_model.bin` is unpickled
only with --allow_pickle, and then with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import numpy as np

from transformer_jax.config import TransformerConfig
from transformer_jax.convert.files import read_json, read_state_dict
from transformer_jax.convert.tensors import ConvertError

# Ours -> Hugging Face activation names (flax's gelu is the tanh approximation: "gelu_new").
ACTIVATIONS = {"relu": "relu", "gelu": "gelu_new", "swish": "swish", "silu": "silu",
               "relu2": "relu2"}
FROM_HF_ACTIVATION = {"relu": "relu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu",
                      "swish": "swish", "silu": "silu", "relu2": "relu2"}
WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin")   # the first found is read
SHARD_INDEX = "model.safetensors.index.json"   # a model saved in shards: their names


def activation_from_hf(name: str, source: str) -> str:
  """Our activation for config.json's `activation_function`; refuses one we lack."""
  if name not in FROM_HF_ACTIVATION:
    raise ConvertError(f"{source}: activation_function={name!r} is an option this project "
                       f"lacks (it has {sorted(FROM_HF_ACTIVATION)}; Hugging Face's 'gelu' "
                       "is exact, ours the tanh approximation)")
  return FROM_HF_ACTIVATION[name]


def our_config(source: str, fields: Callable[[], dict[str, Any]]) -> TransformerConfig:
  """TransformerConfig(**fields()), where `fields` reads config.json (of `source`): a key it
  lacks or a value TransformerConfig refuses ends in one line naming the file."""
  try:
    return TransformerConfig(**fields())
  except KeyError as e:
    raise ConvertError(f"{source}: missing {e.args[0]}") from None
  except ValueError as e:   # TransformerConfig's UserError is one
    raise ConvertError(f"{source}: {e}") from None


def check_options(hf: dict, must_be: dict[str, Any], source: str) -> None:
  """Refuses, naming it, a config.json option set to a value this project cannot compute
  (`must_be`: option -> the only value that converts; an absent option passes)."""
  for option, value in must_be.items():
    if option in hf and hf[option] != value:
      raise ConvertError(f"{source}: {option}={hf[option]!r} is an option this project lacks "
                         f"(only {option}={value!r} converts)")


def mismatch(cfg: TransformerConfig, required: Sequence[tuple[str, Any]],
             name: str) -> str | None:
  """The first of our `required` (field, value) pairs that `cfg` breaks, as one line saying
  that the format `name` has only that value; None if none."""
  for field, value in required:
    if getattr(cfg, field) != value:
      return f"model.{field}={getattr(cfg, field)!r}: {name} only has {field}={value!r}"
  return None


def need_file(directory: str, name: str, layout: str) -> str:
  """The path of `name` in `directory`; if it is missing, an error saying what `layout`
  (e.g. "a MarianMT save_pretrained directory has config.json, ...") holds."""
  path = os.path.join(directory, name)
  if not os.path.isfile(path):
    raise ConvertError(f"{directory}: missing {name} ({layout})")
  return path


def optional_json(directory: str, name: str) -> dict:
  """The JSON file `name` of `directory`, or {} where there is none."""
  path = os.path.join(directory, name)
  return read_json(path) if os.path.isfile(path) else {}


def read_weights(directory: str, allow_pickle: bool) -> tuple[str, dict[str, np.ndarray]]:
  """(path, float32 tensors) of the directory's model.safetensors, its shards (listed by
  model.safetensors.index.json, as save_pretrained writes larger models) or
  pytorch_model.bin."""
  index = os.path.join(directory, SHARD_INDEX)
  if os.path.isfile(index):
    shards = read_json(index).get("weight_map", {}).values()
    state: dict[str, np.ndarray] = {}
    for shard in sorted(set(shards)):
      state.update(read_state_dict(need_file(directory, shard, f"{SHARD_INDEX} lists it"),
                                   allow_pickle))
    return index, state
  for name in WEIGHTS_FILES:
    path = os.path.join(directory, name)
    if os.path.isfile(path):
      return path, read_state_dict(path, allow_pickle)
  raise ConvertError(f"{directory}: missing model.safetensors (or pytorch_model.bin)")


def write_weights(directory: str, state: dict[str, np.ndarray]) -> None:
  """model.safetensors, marked as torch's layout (as save_pretrained marks it)."""
  from safetensors.numpy import save_file
  save_file(state, os.path.join(directory, WEIGHTS_FILES[0]), metadata={"format": "pt"})


def local_or_hub(name: str, patterns: Sequence[str]) -> str:
  """`name` if it is a directory; else the Hub model `name` ("gpt2",
  "openai-community/gpt2"), its files matching `patterns` downloaded (or found in the Hub's
  cache). Where neither works, one line says so."""
  if os.path.isdir(name):
    return name
  looks_like_path = name.startswith(("/", ".", "~")) or name.count("/") > 1
  try:
    if looks_like_path:
      raise FileNotFoundError
    from huggingface_hub import snapshot_download
  except (ImportError, FileNotFoundError):
    raise ConvertError(f"--input={name}: no such directory") from None
  try:
    return snapshot_download(repo_id=name, allow_patterns=list(patterns))
  except Exception as e:   # unreachable, offline, no such model, a gated one
    from huggingface_hub import errors
    if isinstance(e, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
      what = "cannot be reached from here"
    elif isinstance(e, errors.RepositoryNotFoundError):
      what = "has no model of that name that this machine may read"
    else:
      what = "did not give it"
    lines = str(e).strip().splitlines()
    reason = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    raise ConvertError(f"--input={name}: no such directory, and the Hugging Face Hub {what} "
                       f"({reason}); save_pretrained the model and its tokenizer where the Hub "
                       "can be reached, and pass that directory") from None
