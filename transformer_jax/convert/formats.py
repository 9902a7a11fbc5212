"""The formats, one table row each, and `run`: one conversion as the command line gives it.

A row says how to import the format (into a parameter snapshot, W/exports/<name>/), how to
export our newest model to it, and what kind of path each direction takes. Adding a format
is adding a row.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from transformer_jax import checkpoint
from transformer_jax import params as param_utils
from transformer_jax.config import TransformerConfig
from transformer_jax.convert import torch_transformer
from transformer_jax.convert.files import (
  OurModel,
  load_ours,
  read_state_dict,
  save_params_snapshot,
  write_state_dict,
)
from transformer_jax.convert.marian_files import import_marian, write_hf_marian
from transformer_jax.convert.tensors import ConvertError

# (config, params, run config, source tokenizer, target tokenizer)
Imported = tuple[TransformerConfig, dict, dict, Any, Any]


@dataclasses.dataclass(frozen=True)
class Format:
  """One format, both ways. `read(input, allow_pickle, like)` imports it; `write(model,
  output)` exports to it and returns what to tell the user."""
  read: Callable[[str, bool, str | None], Imported]
  write: Callable[[OurModel, str], str]
  input_is_directory: bool    # --input: a directory, or one file
  output_is_directory: bool   # --output: likewise
  needs_like: bool = False    # the file alone does not say the architecture


def _read_marian(input: str, allow_pickle: bool, like: str | None) -> Imported:
  del like
  return import_marian(input, allow_pickle)


def _write_marian(model: OurModel, output: str) -> str:
  note = write_hf_marian(model, output)
  return f"wrote {output}" + (f"\n{note}" if note else "")


def _read_torch(input: str, allow_pickle: bool, like: str | None) -> Imported:
  assert like is not None   # needs_like: convert() refuses --from=torch without --like
  model_dir = os.path.isdir(os.path.join(like, "manifest"))   # an export or checkpoint
  model = load_ours(None if model_dir else like, like if model_dir else None, "--from=torch")
  torch_transformer.check_expressible(model.config)
  params = torch_transformer.params_from_torch_state_dict(
      read_state_dict(input, allow_pickle), model.config, input)
  run_config = dict(model.record.config, model=model.config.to_dict(),
                    converted_from={"format": "torch", "path": os.path.abspath(input)})
  assets = model.record.assets
  return model.config, params, run_config, assets.tokenizer, assets.target_tokenizer


def _write_torch(model: OurModel, output: str) -> str:
  state = torch_transformer.torch_state_dict(model.params, model.config)
  write_state_dict(output, state)
  return f"wrote {output} ({len(state)} tensors of {model.path})"


FORMATS = {
    # Hugging Face MarianMT (OPUS-MT): a save_pretrained directory.
    "hf_marian": Format(_read_marian, _write_marian, input_is_directory=True,
                        output_is_directory=True),
    # torch.nn.Transformer (benchmarks.torch_reference): a state_dict file.
    "torch": Format(_read_torch, _write_torch, input_is_directory=False,
                    output_is_directory=False, needs_like=True),
}


def run(*, from_: str | None = None, to: str | None = None, input: str | None = None,
        output: str | None = None, workdir: str | None = None, checkpoint_path: str | None = None,
        name: str | None = None, like: str | None = None, allow_pickle: bool = False) -> str:
  """Runs one conversion as the command line describes it; returns the lines to print.
  Every argument is checked before a model is read; bad input raises a UserError."""
  if (from_ is None) == (to is None):
    raise ConvertError("give exactly one of --from=FORMAT (import) or --to=FORMAT (export)")
  format_name = from_ or to
  if format_name not in FORMATS:
    raise ConvertError(f"--{'from' if from_ else 'to'}={format_name}: the formats are "
                       f"{', '.join(FORMATS)}")
  fmt = FORMATS[format_name]
  if from_:
    if not input or not workdir:
      raise ConvertError(f"--from={from_} needs --input and --workdir")
    if fmt.needs_like and not like:
      raise ConvertError(f"--from={from_} needs --like=MODEL (an export, checkpoint or "
                         "workdir with the model's config and tokenizer)")
    exists = os.path.isdir if fmt.input_is_directory else os.path.isfile
    if not exists(input):
      raise ConvertError(f"--input={input}: no such "
                         f"{'directory' if fmt.input_is_directory else 'file'}")
    _, params, run_config, source, target = fmt.read(input, allow_pickle, like)
    path = save_params_snapshot(os.path.join(workdir, checkpoint.SNAPSHOT_DIR, name or from_),
                                params, run_config, source, target)
    return f"wrote {path} ({param_utils.count_params(params):,} parameters)"
  if not output:
    raise ConvertError(f"--to={to} needs --output")
  if fmt.output_is_directory and os.path.exists(output) and os.listdir(output):
    raise ConvertError(f"--output={output} exists and is not empty; choose another")
  if not fmt.output_is_directory and os.path.exists(output):
    raise ConvertError(f"--output={output} exists; choose another")
  return fmt.write(load_ours(workdir, checkpoint_path, f"--to={to}"), output)
