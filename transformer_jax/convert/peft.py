"""LoRA adapters in and out as Hugging Face PEFT saves them (`PeftModel.save_pretrained`: a
directory of adapter_config.json and adapter_model.safetensors), for the Llama-shaped
families (Llama, Mistral, Qwen2/3, Gemma 3: their tensor names are `llama.tensor_names`).

  python -m transformer_jax.convert --to=peft --workdir=W --output=DIR
  python -m transformer_jax.convert --from=peft --input=DIR --like=IMPORT --workdir=W

Out: W is a LoRA run (lora.rank > 0) whose base (init_from) is an import of a Hugging Face
model; its adapters become PEFT's, `base_model_name_or_path` that model's directory, so
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(that), DIR)` is the run's
model. In: PEFT LoRA adapters of the model that IMPORT (an import's parameter snapshot,
`convert --from=hf`) holds, merged into it, W/exports/peft (a plain model, as predict,
serving and init_from take it).

The mapping of one kernel (`tensors.kernel_to_linear`'s): PEFT's lora_A.weight (r, in) is
our A (in..., r) flattened to (in, r) and transposed, lora_B.weight (out, r) our B (r,
out...) flattened and transposed; both scale B A by lora_alpha / r (use_rslora: / sqrt(r)).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from transformer_jax import checkpoint, trees
from transformer_jax import params as param_utils
from transformer_jax.config import TransformerConfig
from transformer_jax.convert.files import Imported, OurModel, load_ours
from transformer_jax.convert.hf import read_json
from transformer_jax.convert.llama import PREFIX, tensor_names
from transformer_jax.convert.tensors import ConvertError, linear_to_kernel

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# The families whose tensor names are llama.tensor_names' (GPT-2 fuses q, k and v in c_attn).
FAMILIES = ("hf_llama", "hf_mistral", "hf_qwen2", "hf_qwen3", "hf_gemma3")
_PEFT_PREFIX = "base_model.model."   # PeftModel's prefix before the model's own names


def _kernels(cfg: TransformerConfig) -> dict[str, tuple[str, int]]:
  """{our kernel path: (the family's Linear name without ".weight", its fan-in)}."""
  return {ours: (key.removesuffix(".weight"), fan_in) for ours, key, fan_in in tensor_names(cfg)
          if fan_in is not None}


def _imported_from(record: checkpoint.ModelRecord, what: str) -> str:
  """The Hugging Face directory the model of `record` was imported from."""
  source = record.config.get("converted_from", {})
  if source.get("format") not in FAMILIES:
    raise ConvertError(f"{what} ({record.path}) is not an import of a Llama-shaped Hugging "
                       f"Face model ({', '.join(FAMILIES)}): PEFT adapters name their base "
                       "model by its Hugging Face directory")
  return source["path"]


# ----------------------------------------------------------------------------------- out
def _adapter_state(adapters: dict, cfg: TransformerConfig) -> dict[str, np.ndarray]:
  """PEFT's tensors of our adapters {kernel path: {"a", "b"}} (unrolled layers)."""
  names, state = _kernels(cfg), {}
  flat = trees.flatten(adapters)
  for kernel in sorted({p.rsplit("/", 1)[0] for p in flat}):
    key, fan_in = names[kernel]
    a, b = flat[f"{kernel}/a"], flat[f"{kernel}/b"]
    prefix = f"{_PEFT_PREFIX}{PREFIX}{key}"
    state[f"{prefix}.lora_A.weight"] = a.reshape(fan_in, a.shape[-1]).T
    state[f"{prefix}.lora_B.weight"] = b.reshape(b.shape[0], -1).T
  return {k: np.ascontiguousarray(v, np.float32) for k, v in state.items()}


def write_peft(model: OurModel, output: str) -> str:
  """PEFT's adapter directory at `output` of the LoRA run whose newest model is `model`."""
  try:
    adapters, options, base_path = checkpoint.read_adapters(model.path)
  except checkpoint.IncompatibleCheckpointError as e:
    raise ConvertError(f"--to=peft writes a LoRA run's adapters: {e}") from None
  hf_directory = _imported_from(checkpoint.read_record(base_path),
                                f"its base, init_from={base_path!r}")
  if model.record.config.get("model", {}).get("scan_layers"):
    adapters = param_utils.unstack_layers(adapters)
  from safetensors.numpy import save_file
  os.makedirs(output, exist_ok=True)
  state = _adapter_state(adapters, model.config)
  save_file(state, os.path.join(output, WEIGHTS_FILE), metadata={"format": "pt"})
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": options.rank,
            "lora_alpha": options.alpha, "lora_dropout": options.dropout,
            "target_modules": sorted(options.targets), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "inference_mode": True,
            "base_model_name_or_path": hf_directory}
  with open(os.path.join(output, CONFIG_FILE), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
  return (f"wrote {output} ({len(state) // 2} adapted Linear layers of {model.path}; the base "
          f"model: {hf_directory})")


# ------------------------------------------------------------------------------------ in
def _scale(config: dict, source: str) -> float:
  """LoRA's scale of an adapter_config.json, refusing what a merge cannot express."""
  if config.get("peft_type") != "LORA":
    raise ConvertError(f"{source}: peft_type={config.get('peft_type')!r}; only LORA adapters "
                       "convert")
  for field, plain in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
    if config.get(field, plain) != plain:
      raise ConvertError(f"{source}: {field}={config[field]!r} is not converted (only "
                         f"{field}={plain!r})")
  if config.get("rank_pattern") or config.get("alpha_pattern"):
    raise ConvertError(f"{source}: rank_pattern and alpha_pattern are not converted")
  if config.get("modules_to_save"):
    raise ConvertError(f"{source}: modules_to_save={config['modules_to_save']} (whole trained "
                       "modules) are not converted")
  rank, alpha = config.get("r"), config.get("lora_alpha")
  if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
    raise ConvertError(f"{source}: needs r (an integer >= 1) and lora_alpha (a number)")
  return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def read_peft(input: str, allow_pickle: bool, like: str | None) -> Imported:
  """The model of `like` (an import of the adapters' base) with PEFT's adapters at `input`
  merged into it: W + scale B A per adapted Linear."""
  del allow_pickle
  assert like is not None   # the format's needs_like
  config_path, weights = os.path.join(input, CONFIG_FILE), os.path.join(input, WEIGHTS_FILE)
  if not (os.path.isfile(config_path) and os.path.isfile(weights)):
    raise ConvertError(f"--input={input}: a PEFT adapter directory holds {CONFIG_FILE} and "
                       f"{WEIGHTS_FILE} (PeftModel.save_pretrained)")
  scale = _scale(read_json(config_path), config_path)
  model_dir = os.path.isdir(os.path.join(like, "manifest"))   # an export or checkpoint
  base = load_ours(None if model_dir else like, like if model_dir else None, "--from=peft",
                   "lm")
  _imported_from(base.record, f"--like={like}")
  from safetensors.numpy import load_file
  tensors = load_file(weights)
  params = trees.flatten(base.params)
  by_key = {f"{_PEFT_PREFIX}{PREFIX}{key}": (ours, fan_in)
            for ours, (key, fan_in) in _kernels(base.config).items()}
  merged = 0
  for name in sorted(tensors):
    prefix, _, rest = name.partition(".lora_")
    if rest not in ("A.weight", "B.weight"):
      raise ConvertError(f"{weights}: {name} is not a LoRA A or B weight")
    if prefix not in by_key:
      raise ConvertError(f"{weights}: {name} adapts {prefix.removeprefix(_PEFT_PREFIX)}, "
                         f"which is not a Linear layer of {like}'s model")
    if rest == "B.weight":
      continue
    ours, fan_in = by_key[prefix]
    a, b = tensors[name].astype(np.float32), tensors.get(f"{prefix}.lora_B.weight")
    if b is None or a.shape[1] != fan_in or b.shape[1] != a.shape[0]:
      raise ConvertError(f"{weights}: {prefix}'s lora_A {a.shape} and lora_B "
                         f"{None if b is None else b.shape} do not fit its Linear (fan-in "
                         f"{fan_in})")
    kernel = params[ours]
    delta = linear_to_kernel(scale * (b.astype(np.float32) @ a), kernel.shape)
    params[ours] = (kernel.astype(np.float32) + delta).astype(kernel.dtype)
    merged += 1
  # Still the family's model (--to=hf writes it back there), with the adapters it took.
  run_config = dict(base.record.config, converted_from={
      **base.record.config["converted_from"], "peft_adapters": os.path.abspath(input),
      "adapted_layers": merged})
  assets = base.record.assets
  return base.config, trees.unflatten(params), run_config, assets.tokenizer, \
      assets.target_tokenizer
