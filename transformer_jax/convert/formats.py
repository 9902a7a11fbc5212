"""The formats, one table row each, and `run`: one conversion as the command line gives it.

A row says how to import the format (into a parameter snapshot, W/exports/<name>/), how to
export our newest model to it, and what kind of path each direction takes. Adding a format
is adding a row; a Hugging Face family is also a `model_type` in MODEL_TYPES, which
`--from=hf` reads from config.json to pick the row (`--to=hf`: the row the model was
imported from, else the first family that can express it).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from transformer_jax import checkpoint
from transformer_jax import params as param_utils
from transformer_jax.convert import gemma3, gpt2, llama, mistral, peft, qwen, torch_transformer
from transformer_jax.convert.files import (
  Imported,
  OurModel,
  load_ours,
  read_state_dict,
  save_params_snapshot,
  write_state_dict,
)
from transformer_jax.convert.hf import local_or_hub, read_json
from transformer_jax.convert.hf_lm import Family
from transformer_jax.convert.marian_files import import_marian, write_hf_marian
from transformer_jax.convert.tensors import ConvertError
from transformer_jax.tasks import LanguageModelTask, Seq2SeqTask


@dataclasses.dataclass(frozen=True)
class Format:
  """One format, both ways. `read(input, allow_pickle, like)` imports it; `write(model,
  output)` exports to it and returns what to tell the user."""
  read: Callable[[str, bool, str | None], Imported]
  write: Callable[[OurModel, str], str]
  input_is_directory: bool    # --input: a directory, or one file
  output_is_directory: bool   # --output: likewise
  needs_like: bool = False    # the file alone does not say the architecture
  task: str = Seq2SeqTask.name   # the task of the models it holds
  hub_files: tuple[str, ...] = ()   # --input may name a Hub model instead: these files of it
  writes_params: bool = True  # False: write reads the checkpoint itself (model.params is {})


def _hf_directory(load: Callable[[str, bool], Imported]) -> Callable[..., Imported]:
  """A reader of a save_pretrained directory (which needs no --like)."""
  def read(input: str, allow_pickle: bool, like: str | None) -> Imported:
    del like
    return load(input, allow_pickle)
  return read


def _with_notes(write: Callable[[OurModel, str], str]) -> Callable[[OurModel, str], str]:
  """A writer of a save_pretrained directory, telling where, and its notes."""
  def write_and_tell(model: OurModel, output: str) -> str:
    note = write(model, output)
    return f"wrote {output}" + (f"\n{note}" if note else "")
  return write_and_tell


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


# The Hugging Face causal LM families, in the order --to=hf tries them on a model trained here.
LM_FAMILIES: dict[str, Family] = {family.name: family for family in (
    llama.FAMILY, mistral.FAMILY, qwen.FAMILY_QWEN2, qwen.FAMILY_QWEN3, gemma3.FAMILY,
    gpt2.FAMILY)}


def _lm_row(family: Family, hub_files: tuple[str, ...] = llama.HUB_FILES) -> Format:
  """A Hugging Face causal LM family's row: a save_pretrained directory, or a Hub model."""
  return Format(_hf_directory(family.read), _with_notes(family.write), input_is_directory=True,
                output_is_directory=True, task=LanguageModelTask.name, hub_files=hub_files)


FORMATS = {
    # Hugging Face MarianMT (OPUS-MT): a save_pretrained directory.
    "hf_marian": Format(_hf_directory(import_marian), _with_notes(write_hf_marian),
                        input_is_directory=True, output_is_directory=True),
    # Hugging Face GPT-2 (GPT2LMHeadModel and its tokenizer): a save_pretrained directory,
    # or a model of the Hub ("gpt2") where it can be reached.
    "hf_gpt2": _lm_row(gpt2.FAMILY, gpt2.HUB_FILES),
    # Hugging Face causal LMs with a tokenizer.json (LlamaForCausalLM, MistralForCausalLM,
    # Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM): a save_pretrained directory,
    # or a model of the Hub.
    **{row: _lm_row(family) for row, family in LM_FAMILIES.items() if row != "hf_gpt2"},
    # Hugging Face PEFT's LoRA adapters of a Llama-shaped import (convert/peft.py): out, a
    # LoRA run's; in, merged into the import that --like names.
    "peft": Format(peft.read_peft, peft.write_peft, input_is_directory=True,
                   output_is_directory=True, needs_like=True, task=LanguageModelTask.name,
                   writes_params=False),
    # torch.nn.Transformer (benchmarks.torch_reference): a state_dict file.
    "torch": Format(_read_torch, _write_torch, input_is_directory=False,
                    output_is_directory=False, needs_like=True),
}
# config.json's model_type -> the row that converts it (--from=hf, --to=hf).
MODEL_TYPES = {"marian": "hf_marian", "gpt2": "hf_gpt2", "llama": "hf_llama",
               "mistral": "hf_mistral", "qwen2": "hf_qwen2", "qwen3": "hf_qwen3",
               "gemma3_text": "hf_gemma3"}
AUTO = "hf"   # --from=hf / --to=hf: the family named by config.json, or the model's
_HF_FILES = tuple(sorted({*gpt2.HUB_FILES, *llama.HUB_FILES}))


def family_of(directory: str) -> str:
  """The row of a save_pretrained directory, by its config.json's model_type."""
  path = os.path.join(directory, "config.json")
  if not os.path.isfile(path):
    raise ConvertError(f"--input={directory}: missing config.json (--from=hf reads the "
                       "model_type there)")
  model_type = read_json(path).get("model_type")
  if model_type not in MODEL_TYPES:
    raise ConvertError(f"{path}: model_type={model_type!r} is a family this project lacks "
                       f"(it converts {', '.join(sorted(MODEL_TYPES))})")
  return MODEL_TYPES[model_type]


def _family_for(model: OurModel) -> str:
  """--to=hf: the row the model was imported from, else the first family that can express
  it (a translation model: MarianMT)."""
  imported = model.record.config.get("converted_from", {}).get("format")
  if imported in MODEL_TYPES.values():
    return imported
  if model.config.num_encoder_layers:
    return "hf_marian"
  problems = [family.incompatibility(model.config, model.record.assets.tokenizer)
              for family in LM_FAMILIES.values()]
  for row, problem in zip(LM_FAMILIES, problems):
    if problem is None:
      return row
  raise ConvertError(f"{model.path}: --to=hf: no Hugging Face family expresses this model "
                     f"(Llama: {problems[0]}); name one with --to=")


def run(*, from_: str | None = None, to: str | None = None, input: str | None = None,
        output: str | None = None, workdir: str | None = None, checkpoint_path: str | None = None,
        name: str | None = None, like: str | None = None, allow_pickle: bool = False) -> str:
  """Runs one conversion as the command line describes it; returns the lines to print.
  Every argument is checked before a model is read; bad input raises a UserError."""
  if (from_ is None) == (to is None):
    raise ConvertError("give exactly one of --from=FORMAT (import) or --to=FORMAT (export)")
  format_name = from_ or to
  if format_name not in (*FORMATS, AUTO):
    raise ConvertError(f"--{'from' if from_ else 'to'}={format_name}: the formats are "
                       f"{', '.join((AUTO, *FORMATS))}")
  if from_ == AUTO:
    if not input or not workdir:
      raise ConvertError(f"--from={from_} needs --input and --workdir")
    from_ = family_of(local_or_hub(input, _HF_FILES))
    return run(from_=from_, input=input, workdir=workdir, name=name, allow_pickle=allow_pickle)
  fmt = FORMATS["hf_llama" if to == AUTO else format_name]   # AUTO: a directory too
  if from_:
    if not input or not workdir:
      raise ConvertError(f"--from={from_} needs --input and --workdir")
    if fmt.needs_like and not like:
      raise ConvertError(f"--from={from_} needs --like=MODEL (an export, checkpoint or "
                         "workdir with the model's config and tokenizer)")
    snapshot = os.path.join(workdir, checkpoint.SNAPSHOT_DIR, name or from_)
    if os.path.exists(snapshot):   # before a download
      raise ConvertError(f"{os.path.abspath(snapshot)} already exists; remove it or use "
                         "another --name")
    if fmt.hub_files:
      input = local_or_hub(input, fmt.hub_files)
    exists = os.path.isdir if fmt.input_is_directory else os.path.isfile
    if not exists(input):
      raise ConvertError(f"--input={input}: no such "
                         f"{'directory' if fmt.input_is_directory else 'file'}")
    _, params, run_config, source, target = fmt.read(input, allow_pickle, like)
    path = save_params_snapshot(snapshot, params, run_config, source, target)
    return f"wrote {path} ({param_utils.count_params(params):,} parameters)"
  if not output:
    raise ConvertError(f"--to={to} needs --output")
  if fmt.output_is_directory and os.path.exists(output) and os.listdir(output):
    raise ConvertError(f"--output={output} exists and is not empty; choose another")
  if not fmt.output_is_directory and os.path.exists(output):
    raise ConvertError(f"--output={output} exists; choose another")
  if to == AUTO:
    _, record = checkpoint.load_newest(workdir, checkpoint.read_record, checkpoint_path)
    model = load_ours(workdir, checkpoint_path, "--to=hf",
                      record.config.get("task", Seq2SeqTask.name))
    fmt = FORMATS[_family_for(model)]
  else:
    model = load_ours(workdir, checkpoint_path, f"--to={to}", fmt.task, fmt.writes_params)
  return fmt.write(model, output)
