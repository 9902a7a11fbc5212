"""The decoder-only language model in PyTorch, for `benchmarks.train_step --compare=torch` on
an lm config: the JAX `LanguageModel` (modules/models.py) written out in torch.

Token embedding (scaled by sqrt(d_model), unless the config says not) plus learned (or
sinusoidal) positions, N blocks of causal self-attention
(`F.scaled_dot_product_attention(is_causal=True)`: flash attention on a GPU) and a
feed-forward network, each in a pre-LN (or post-LN) residual, a final LayerNorm when
pre-LN, and the output projection tied to the embedding (or its own, with a bias under use_bias). The loss is the mean (label-smoothed) cross-entropy over non-padding targets. Rows
are padded at their ends only (stream windows), so the causal mask alone hides padding
keys from every real query. Options the JAX model has and this one does not mirror (rotary
positions, RMSNorm, a gated feed-forward, grouped-query attention, ...) are refused in one
line. `load_jax_params` copies the JAX model's parameters in (tests: the same logits).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from transformer_jax import errors
from transformer_jax.config import PAD_ID, TransformerConfig
from transformer_jax.modules.embedding import sinusoidal_table

_UNMIRRORED = {   # option: (the value mirrored here, what to say)
    "positional": (("learned", "sinusoidal"), "learned or sinusoidal positions"),
    "norm_type": (("layer",), "LayerNorm"),
    "gated_ffn": ((False,), "an ungated feed-forward"),
    "final_logits_bias": ((False,), "no final logits bias"),
    "zero_decoder_start": ((False,), "a BOS embedded like any token"),
    "bos_is_eos": ((False,), "separate BOS and EOS tokens"),
}


def check_mirrored(cfg: TransformerConfig) -> None:
  """UserError (one line) for a model option the torch GPT does not mirror."""
  for field, (values, what) in _UNMIRRORED.items():
    if getattr(cfg, field) not in values:
      raise errors.UserError(f"--compare=torch mirrors {what}: model.{field}="
                             f"{getattr(cfg, field)!r} has no PyTorch counterpart here; "
                             "drop --compare")
  if cfg.kv_heads != cfg.num_heads:
    raise errors.UserError(f"--compare=torch mirrors multi-head attention: model.num_kv_heads="
                           f"{cfg.num_kv_heads} (grouped-query) has no PyTorch counterpart "
                           "here; drop --compare")


class Block(nn.Module):
  """Causal self-attention then the feed-forward network, each in a residual."""

  def __init__(self, cfg: TransformerConfig):
    super().__init__()
    d, bias = cfg.d_model, cfg.use_bias
    self.heads, self.pre = cfg.num_heads, cfg.norm_position == "pre"
    self.attention_dropout = cfg.attention_dropout_rate
    self.attention_norm = nn.LayerNorm(d, eps=cfg.layer_norm_epsilon, bias=bias)
    self.qkv = nn.Linear(d, 3 * d, bias=bias)               # query, key, value side by side
    self.out = nn.Linear(d, d, bias=bias)
    self.ffn_norm = nn.LayerNorm(d, eps=cfg.layer_norm_epsilon, bias=bias)
    self.wi = nn.Linear(d, cfg.d_ff, bias=bias)
    self.wo = nn.Linear(cfg.d_ff, d, bias=bias)
    # flax's gelu is the tanh approximation; swish and silu are one function.
    self.activation = {"relu": F.relu, "gelu": functools.partial(F.gelu, approximate="tanh"),
                       "swish": F.silu, "silu": F.silu}[cfg.activation]
    self.activation_dropout = nn.Dropout(cfg.activation_dropout_rate)
    self.dropout = nn.Dropout(cfg.dropout_rate)

  def attention(self, x: torch.Tensor) -> torch.Tensor:
    b, t, d = x.shape
    q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(                     # (B, N, T, H)
        q, k, v, is_causal=True, dropout_p=self.attention_dropout if self.training else 0.0)
    return self.out(y.transpose(1, 2).reshape(b, t, d))

  def ffn(self, x: torch.Tensor) -> torch.Tensor:
    return self.wo(self.activation_dropout(self.activation(self.wi(x))))

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    if self.pre:
      x = x + self.dropout(self.attention(self.attention_norm(x)))
      return x + self.dropout(self.ffn(self.ffn_norm(x)))
    x = self.attention_norm(x + self.dropout(self.attention(x)))
    return self.ffn_norm(x + self.dropout(self.ffn(x)))


class TorchGPT(nn.Module):
  """The JAX `LanguageModel`; forward(inputs, targets) (B, T) returns the mean loss."""

  def __init__(self, cfg: TransformerConfig, label_smoothing: float = 0.0):
    super().__init__()
    check_mirrored(cfg)
    d = cfg.d_model
    self.config, self.label_smoothing = cfg, label_smoothing
    self.embedding = nn.Embedding(cfg.vocab_size, d)
    nn.init.normal_(self.embedding.weight, std=d ** -0.5)
    if cfg.positional == "learned":
      self.positions = nn.Parameter(torch.randn(cfg.max_len, d) * 0.02)
    else:   # fixed: a buffer, not a parameter
      self.register_buffer("positions", torch.from_numpy(sinusoidal_table(
          cfg.max_len, d, cfg.sinusoidal_layout)), persistent=False)
    self.dropout = nn.Dropout(cfg.dropout_rate)
    self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_decoder_layers))
    pre = cfg.norm_position == "pre"
    self.final_norm = (nn.LayerNorm(d, eps=cfg.layer_norm_epsilon, bias=cfg.use_bias)
                       if pre else None)
    self.output = None if cfg.tie_output else nn.Linear(d, cfg.vocab_size, bias=cfg.use_bias)

  def logits(self, inputs: torch.Tensor) -> torch.Tensor:
    """(B, T) token ids -> float32 logits (B, T, V) of each next token."""
    x = self.embedding(inputs)
    if self.config.scale_embeddings:     # GPT-2's are not scaled
      x = x * math.sqrt(self.config.d_model)
    x = self.dropout(x + self.positions[:inputs.shape[1]])
    for block in self.blocks:
      x = block(x)
    if self.final_norm is not None:
      x = self.final_norm(x)
    logits = F.linear(x, self.embedding.weight) if self.output is None else self.output(x)
    return logits.float()

  def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = self.logits(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=PAD_ID, label_smoothing=self.label_smoothing,
                           reduction="sum")
    return loss / (targets != PAD_ID).sum()

  @torch.no_grad()
  def load_jax_params(self, params: Any) -> None:
    """Copies the JAX LanguageModel's parameters (unrolled layers, separate or fused
    query/key/value) into this model."""
    params = {k: _numpy(v) for k, v in params.items()}
    d, decoder = self.config.d_model, params["decoder"]
    state = {"embedding.weight": _tensor(params["embedding"]["embedding"])}
    if self.config.positional == "learned":
      state["positions"] = _tensor(decoder["input_embedding"]["positional"]["position_embedding"])
    for i in range(self.config.num_decoder_layers):
      layer, name = decoder[f"layer_{i}"], f"blocks.{i}."
      attention = layer["self_attention"]
      if "qkv" in attention:        # (D, 3, N, H) -> three (D, N, H)
        parts = [{k: np.take(v, j, axis=1 if k == "kernel" else 0)
                  for k, v in attention["qkv"].items()} for j in range(3)]
      else:
        parts = [attention[k] for k in ("query", "key", "value")]
      qkv = {k: np.concatenate([np.reshape(p[k], (d, d) if k == "kernel" else -1)
                                for p in parts], -1) for k in parts[0]}
      _linear(state, f"{name}qkv", qkv, (d, d * 3))
      _linear(state, f"{name}out", attention["out"], (d, d))
      _linear(state, f"{name}wi", layer["feed_forward"]["wi"])
      _linear(state, f"{name}wo", layer["feed_forward"]["wo"])
      _norm(state, f"{name}attention_norm", layer["self_attention_norm"])
      _norm(state, f"{name}ffn_norm", layer["feed_forward_norm"])
    if self.final_norm is not None:
      _norm(state, "final_norm", decoder["final_norm"])
    if self.output is not None:
      _linear(state, "output", decoder["output_projection"])
    self.load_state_dict(state)


def _numpy(tree: Any) -> Any:
  """Nested dicts of arrays (JAX's or numpy's) as numpy arrays."""
  return ({k: _numpy(v) for k, v in tree.items()} if isinstance(tree, dict)
          else np.asarray(tree))


def _tensor(x: Any) -> torch.Tensor:
  return torch.from_numpy(np.array(x, np.float32))


def _linear(state: dict[str, torch.Tensor], name: str, p: Any,
            shape: tuple[int, int] | None = None) -> None:
  """A flax kernel (in, ...) -> torch's weight (out, in), and its bias."""
  kernel = np.asarray(p["kernel"])
  state[f"{name}.weight"] = _tensor(np.reshape(kernel, shape) if shape else kernel).T
  if "bias" in p:
    state[f"{name}.bias"] = _tensor(np.reshape(p["bias"], -1))


def _norm(state: dict[str, torch.Tensor], name: str, p: Any) -> None:
  state[f"{name}.weight"] = _tensor(p["scale"])
  if "bias" in p:
    state[f"{name}.bias"] = _tensor(p["bias"])
