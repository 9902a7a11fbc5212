"""Reading and writing for every format: JSON and tensor files, our own models in and out.

`load_ours` reads the model an export converts (the one `predict` would use) and
`save_params_snapshot` writes what an import produces: a parameter snapshot,
W/exports/<name>/, in the format of `python -m transformer_jax.export`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np

from transformer_jax import checkpoint
from transformer_jax import params as param_utils
from transformer_jax.config import TransformerConfig
from transformer_jax.convert.tensors import ConvertError
from transformer_jax.data.tokenizer import tokenizer_item
from transformer_jax.options import TrainOptions
from transformer_jax.renamed_fields import upgrade
from transformer_jax.tasks import Seq2SeqTask, split_model_fields, task_class


def read_json(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ConvertError(f"{path}: not valid JSON ({e})") from None


def write_json(path: str, content: dict) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(content, f, indent=2, ensure_ascii=False)


def read_state_dict(path: str, allow_pickle: bool) -> dict[str, np.ndarray]:
  """Tensors of a .safetensors file (through JAX: numpy has no bfloat16, the dtype of most
  uploads; no torch needed) or, with allow_pickle, of a torch pickle read with
  `torch.load(weights_only=True)`; float32 numpy arrays."""
  if path.endswith(".safetensors"):
    from safetensors import safe_open
    with safe_open(path, framework="flax") as f:
      return {k: np.asarray(f.get_tensor(k), np.float32) for k in f.keys()}
  if not allow_pickle:
    raise ConvertError(f"{path} is a pickle; pass --allow_pickle to read it (with "
                       "torch.load(weights_only=True)), or convert it to safetensors")
  import torch
  loaded = torch.load(path, map_location="cpu", weights_only=True)
  return {k: v.float().numpy() for k, v in loaded.items()}


def write_state_dict(path: str, state: dict[str, np.ndarray]) -> None:
  """A .safetensors file, or else a torch.save pickle."""
  if path.endswith(".safetensors"):
    from safetensors.numpy import save_file
    save_file(state, path)
  else:
    import torch
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, path)


# What an import gives: (config, params, run config, source tokenizer, target tokenizer).
Imported = tuple[TransformerConfig, dict, dict, Any, Any]


@dataclasses.dataclass
class OurModel:
  """A model of this project (a translation model or a language model), as the converters
  take it."""
  path: str                 # the checkpoint or export it was read from
  config: TransformerConfig  # scan_layers=False, fused_qkv=False
  params: dict               # unrolled, separate-QKV numpy parameters
  record: checkpoint.ModelRecord   # its run config and tokenizers


def load_ours(workdir: str | None, checkpoint_path: str | None, purpose: str,
              task: str = Seq2SeqTask.name, with_params: bool = True) -> OurModel:
  """The model `predict` would use (--checkpoint, or the newest export or checkpoint of the
  workdir) for `purpose` (e.g. "--to=hf_marian"), which converts models of `task` only.
  with_params=False: its config and record only (params {}), for a writer that reads the
  checkpoint itself (a LoRA run's adapters: no merge with its base)."""
  path, (record, params) = checkpoint.load_newest(
      workdir, lambda p: (checkpoint.read_record(p),
                          checkpoint.restore_params(p) if with_params else {}),
      checkpoint_path)
  saved_task = TrainOptions.from_dict(upgrade(record.config)).task
  if saved_task != task:
    raise ConvertError(f"{path}: convert {purpose} converts models of task={task!r} only; "
                       f"this is a task={saved_task!r} model")
  fields, _ = split_model_fields(task_class(task), record.config["model"])   # no head options
  cfg = TransformerConfig.from_dict(fields)
  params = jax.tree_util.tree_map(np.asarray, params)
  if cfg.scan_layers and with_params:
    params = param_utils.unstack_layers(params)
  if cfg.fused_qkv and with_params:
    params = param_utils.split_qkv(params)
  return OurModel(path, cfg.replace(scan_layers=False, fused_qkv=False), params, record)


def save_params_snapshot(path: str, params: dict, run_config: dict, tokenizer: Any,
                         target_tokenizer: Any) -> str:
  """A parameter snapshot at `path` (params, run config, tokenizers, manifest; step 0), as
  `python -m transformer_jax.export` writes it and `predict`/`train.py --eval_only` and
  `init_from` read it. Returns its absolute path."""
  if os.path.exists(path):
    raise ConvertError(f"{os.path.abspath(path)} already exists; remove it or use another "
                       "--name")
  params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params)
  return checkpoint.write_snapshot(path, params, run_config,
                                 tokenizer_item(tokenizer, target_tokenizer), steps=[0])
