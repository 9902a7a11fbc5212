"""torch.nn.Transformer's names for our model: the state_dict of
`benchmarks.torch_reference.TorchTransformer` (a batch-first torch.nn.Transformer with custom
stacks, under "transformer.", one shared token embedding "embedding.weight", and learned
positions "positions.{encoder,decoder}"). Pure tables; the file is written by
`files.write_state_dict` and read by `files.read_state_dict`.

(Named torch_transformer rather than torch: a module `torch` inside this package would
read as the real torch wherever it is imported by its short name.)
"""

from __future__ import annotations

import numpy as np

from transformer_jax import trees
from transformer_jax.config import TransformerConfig
from transformer_jax.convert.tensors import (
  QKV,
  ConvertError,
  check_shape,
  kernel_to_linear,
  layer_tensors,
  layers,
  linear_to_kernel,
  sublayer_type,
  zero_params,
)


def torch_state_dict(params: dict, cfg: TransformerConfig) -> dict[str, np.ndarray]:
  """The state_dict (numpy) holding our unrolled, separate-QKV parameters of a shared,
  tied model."""
  check_expressible(cfg)
  state = {key: to_theirs(np.asarray(trees.get_path(params, ours), np.float32))
           for ours, key, _, to_theirs in layer_tensors(cfg, "torch")}
  for stack, i, ours, _, torch_name in layers(cfg):
    if sublayer_type(ours) == "attention":
      mine = trees.get_path(params, f"{stack}/layer_{i}/{ours}")
      prefix = f"transformer.{stack}.layers.{i}.{torch_name}"
      state[f"{prefix}.in_proj_weight"] = np.concatenate(
          [kernel_to_linear(np.asarray(mine[q]["kernel"]), cfg.d_model) for q, _ in QKV])
      state[f"{prefix}.in_proj_bias"] = np.concatenate(
          [np.asarray(mine[q]["bias"]).reshape(-1) for q, _ in QKV])
  state["embedding.weight"] = np.asarray(params["shared_embedding"]["embedding"])
  for stack in ("encoder", "decoder"):
    if cfg.norm_position == "pre":
      state[f"transformer.{stack}.norm.weight"] = np.asarray(params[stack]["final_norm"]["scale"])
      state[f"transformer.{stack}.norm.bias"] = np.asarray(params[stack]["final_norm"]["bias"])
    if cfg.positional == "learned":
      state[f"positions.{stack}"] = np.asarray(
          params[stack]["input_embedding"]["positional"]["position_embedding"])
  return {k: np.asarray(v, np.float32) for k, v in state.items()}


def params_from_torch_state_dict(state: dict[str, np.ndarray], cfg: TransformerConfig,
                                 source: str = "state_dict") -> dict:
  """The inverse of `torch_state_dict`: our parameter tree; names the first missing,
  unexpected or mis-shaped tensor."""
  check_expressible(cfg)
  expected = torch_state_dict(zero_params(cfg), cfg)
  for key, value in expected.items():
    if key not in state:
      raise ConvertError(f"{source}: missing tensor {key}")
    check_shape(key, np.asarray(state[key]), value.shape, source)
  unexpected = sorted(set(state) - set(expected))
  if unexpected:
    raise ConvertError(f"{source}: unexpected tensor {unexpected[0]} ({len(unexpected)} in all)")
  params: dict = {}
  for ours, key, to_ours, _ in layer_tensors(cfg, "torch"):
    trees.set_path(params, ours, to_ours(np.asarray(state[key], np.float32)))
  d, n, h = cfg.d_model, cfg.num_heads, cfg.head_dim
  for stack, i, ours, _, torch_name in layers(cfg):
    if sublayer_type(ours) == "attention":
      prefix = f"transformer.{stack}.layers.{i}.{torch_name}"
      weights = np.split(np.asarray(state[f"{prefix}.in_proj_weight"], np.float32), 3)
      biases = np.split(np.asarray(state[f"{prefix}.in_proj_bias"], np.float32), 3)
      for (q, _), w, b in zip(QKV, weights, biases):
        mine = f"{stack}/layer_{i}/{ours}/{q}"
        trees.set_path(params, f"{mine}/kernel", linear_to_kernel(w, (d, n, h)))
        trees.set_path(params, f"{mine}/bias", b.reshape(n, h))
  trees.set_path(params, "shared_embedding/embedding",
                 np.asarray(state["embedding.weight"], np.float32))
  for stack in ("encoder", "decoder"):
    if cfg.norm_position == "pre":
      for ours, theirs in (("scale", "weight"), ("bias", "bias")):
        trees.set_path(params, f"{stack}/final_norm/{ours}",
                       np.asarray(state[f"transformer.{stack}.norm.{theirs}"], np.float32))
    if cfg.positional == "learned":
      trees.set_path(params, f"{stack}/input_embedding/positional/position_embedding",
                     np.asarray(state[f"positions.{stack}"], np.float32))
  return params


def check_expressible(cfg: TransformerConfig) -> None:
  """Raises ConvertError, naming the option, unless torch.nn.Transformer can hold `cfg`."""
  if not (cfg.share_embeddings and cfg.tie_output and cfg.target_vocab_size is None):
    raise ConvertError("torch.nn.Transformer conversion needs share_embeddings=True and "
                       "tie_output=True (one embedding, tied to the output)")
  if cfg.final_logits_bias:
    raise ConvertError("model.final_logits_bias=True: torch.nn.Transformer has no output bias")
