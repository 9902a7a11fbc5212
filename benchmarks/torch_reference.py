"""The same train step in PyTorch, for `benchmarks.train_step --compare=torch`: for a seq2seq
config the model below, for an lm config the GPT of benchmarks/torch_gpt.py.

`torch.nn.Transformer` with the JAX model's dimensions, vocabulary, dropout rates,
activation and norm position; shared token embedding scaled by sqrt(d_model), sinusoidal (or
learned) positions, output projection tied to the embedding, label-smoothed cross-entropy
over non-padding targets. Post-LN stacks get no final LayerNorm, as in the paper and the JAX
model, so both have exactly the same parameters (checked, for either task). The optimizer is
Adam, or AdamW with the config's weight decay (on matrices only where the config says so),
with the config's betas and eps, and clipping where the config clips. Run eagerly and
under `torch.compile` (the model with its loss, and the optimizer step), on the same batch,
in the same process.

PyTorch is an optional benchmark dependency: benchmarks/requirements-torch.txt.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from typing import Any, Callable

import numpy as np

from benchmarks import common
from transformer_jax import convert, errors
from transformer_jax.config import PAD_ID, TransformerConfig
from transformer_jax.modules.embedding import sinusoidal_table

try:
  import torch
  import torch.nn.functional as F
  from torch import nn
except ImportError as e:  # pragma: no cover - depends on the environment
  raise errors.UserError("--compare=torch needs PyTorch: pip install -r "
                         "benchmarks/requirements-torch.txt") from e


class TorchTransformer(nn.Module):
  """The JAX `Transformer` (shared vocabulary) built from torch.nn.Transformer; forward
  returns the mean label-smoothed loss over non-padding targets."""

  def __init__(self, cfg: TransformerConfig, label_smoothing: float):
    super().__init__()
    if not (cfg.share_embeddings and cfg.tie_output):
      raise errors.UserError("--compare=torch supports shared, tied embeddings (the paper's): "
                             "set model.share_embeddings and model.tie_output")
    d, pre = cfg.d_model, cfg.norm_position == "pre"
    self.config = cfg
    self.d_model, self.label_smoothing = d, label_smoothing
    self.embedding = nn.Embedding(cfg.vocab_size, d)
    nn.init.normal_(self.embedding.weight, std=d ** -0.5)
    if cfg.positional == "learned":    # one table per stack, as in the JAX model
      self.positions = nn.ParameterDict({k: nn.Parameter(torch.randn(cfg.max_len, d) * 0.02)
                                         for k in ("encoder", "decoder")})
    else:
      self.positions = None
      # Not persistent: fixed, so not part of the state_dict that convert/torch_transformer.py maps.
      self.register_buffer("sinusoids", torch.from_numpy(sinusoidal_table(cfg.max_len, d)),
                           persistent=False)
    self.dropout = nn.Dropout(cfg.dropout_rate)
    # flax's gelu is the tanh approximation.
    activation = (functools.partial(F.gelu, approximate="tanh") if cfg.activation == "gelu"
                  else cfg.activation)
    layer_args = dict(d_model=d, nhead=cfg.num_heads, dim_feedforward=cfg.d_ff,
                      dropout=cfg.dropout_rate, activation=activation,
                      layer_norm_eps=cfg.layer_norm_epsilon, batch_first=True, norm_first=pre)
    final_norm = lambda: nn.LayerNorm(d, eps=cfg.layer_norm_epsilon) if pre else None
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(**layer_args),
                                    cfg.num_encoder_layers, norm=final_norm(),
                                    enable_nested_tensor=False)
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(**layer_args),
                                    cfg.num_decoder_layers, norm=final_norm())
    self.transformer = nn.Transformer(d_model=d, nhead=cfg.num_heads, batch_first=True,
                                      custom_encoder=encoder, custom_decoder=decoder)
    # torch uses one rate everywhere; the JAX config separates attention-weight and
    # feed-forward-activation dropout (0 in the paper) from residual dropout.
    for layer in [*encoder.layers, *decoder.layers]:
      layer.self_attn.dropout = cfg.attention_dropout_rate
      if hasattr(layer, "multihead_attn"):
        layer.multihead_attn.dropout = cfg.attention_dropout_rate
      layer.dropout.p = cfg.activation_dropout_rate

  def embed(self, tokens: torch.Tensor, stack: str) -> torch.Tensor:
    table = self.sinusoids if self.positions is None else self.positions[stack]
    x = self.embedding(tokens) * math.sqrt(self.d_model) + table[:tokens.shape[1]]
    return self.dropout(x)

  def logits(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
    length = tgt_in.shape[1]
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=src.device), 1)
    src_pad, tgt_pad = src == PAD_ID, tgt_in == PAD_ID
    y = self.transformer(self.embed(src, "encoder"), self.embed(tgt_in, "decoder"),
                         tgt_mask=causal,
                         src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
                         memory_key_padding_mask=src_pad, tgt_is_causal=True)
    return F.linear(y, self.embedding.weight).float()

  def forward(self, src: torch.Tensor, tgt_in: torch.Tensor,
              tgt_out: torch.Tensor) -> torch.Tensor:
    logits = self.logits(src, tgt_in)
    # torch spreads the smoothing mass over all V classes, the JAX loss over the V - 1 wrong
    # ones: the same cost, slightly different targets.
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1),
                           ignore_index=PAD_ID, label_smoothing=self.label_smoothing,
                           reduction="sum")
    return loss / (tgt_out != PAD_ID).sum()

  @torch.no_grad()
  def load_jax_params(self, params: Any) -> None:
    """Copies the JAX model's (unrolled, separate-QKV) parameters into this model, through
    `transformer_jax.convert.torch_state_dict` (this module's state_dict layout)."""
    self.load_state_dict({k: torch.from_numpy(v)
                          for k, v in convert.torch_state_dict(params, self.config).items()})


def check_mirrored(s: common.Setup) -> None:
  """UserError (one line) for a model option or optimizer the PyTorch side does not mirror."""
  if s.config.optimizer.name not in ("adam", "adamw"):
    raise errors.UserError(f"--compare=torch mirrors Adam and AdamW, not "
                           f"optimizer.name={s.config.optimizer.name!r}: add "
                           "--config.optimizer.name=adamw, or drop --compare")
  if s.task == "lm":
    from benchmarks.torch_gpt import check_mirrored
    check_mirrored(s.model)
  elif not (s.model.share_embeddings and s.model.tie_output):
    raise errors.UserError("--compare=torch supports shared, tied embeddings (the paper's): "
                           "set model.share_embeddings and model.tie_output")
  elif not s.model.scale_embeddings or s.model.bos_is_eos:
    raise errors.UserError("--compare=torch mirrors the paper's embeddings (scaled by "
                           "sqrt(d_model), separate BOS and EOS): set model.scale_embeddings "
                           "and unset model.bos_is_eos, or drop --compare")


def _model(s: common.Setup) -> tuple[nn.Module, tuple[str, ...]]:
  """The PyTorch model of the benchmark's task and the batch keys its forward takes."""
  if s.task == "lm":
    from benchmarks.torch_gpt import TorchGPT
    return TorchGPT(s.model, s.config.label_smoothing), ("inputs", "targets")
  return TorchTransformer(s.model, s.config.label_smoothing), ("src", "tgt_in", "tgt_out")


def _jax_parameters(s: common.Setup, batch: dict[str, np.ndarray]) -> int:
  """The JAX model's parameter count (shapes only)."""
  import jax

  from transformer_jax.modules.models import LanguageModel, Transformer
  from transformer_jax.params import count_params
  if s.task == "lm":
    init = lambda: LanguageModel(s.model).init(jax.random.PRNGKey(0), batch["inputs"][:1])
  else:
    init = lambda: Transformer(s.model).init(jax.random.PRNGKey(0), batch["src"][:1],
                                             batch["tgt_in"][:1])
  return count_params(jax.eval_shape(init)["params"])


def _optimizer(model: nn.Module, opt_cfg: Any) -> torch.optim.Optimizer:
  """Adam, or AdamW with the config's decay (on matrices and embeddings only, as the JAX
  optimizer's decay_matrices_only), with the config's betas and eps."""
  lr = float(opt_cfg.learning_rate) if float(opt_cfg.learning_rate) > 0 else 1e-4
  betas = (opt_cfg.b1, opt_cfg.b2)
  if opt_cfg.name != "adamw":
    return torch.optim.Adam(model.parameters(), lr=lr, betas=betas, eps=opt_cfg.eps)
  decay = float(opt_cfg.weight_decay)
  if opt_cfg.get("decay_matrices_only", False):
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2]},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
  else:
    groups = [{"params": list(model.parameters())}]
  return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=opt_cfg.eps, weight_decay=decay)


def _train_step(s: common.Setup, batch: dict[str, np.ndarray], compiled: bool, device: str,
                seed: int):
  """(model, step function): one optimizer step on `batch` per call, synchronised."""
  torch.manual_seed(seed)
  model, keys = _model(s)
  model = model.to(device).train()
  opt_cfg = s.config.optimizer
  optimizer = _optimizer(model, opt_cfg)
  tensors = [torch.from_numpy(batch[k]).long().to(device) for k in keys]
  loss_fn = torch.compile(model) if compiled else model
  opt_step = torch.compile(optimizer.step) if compiled else optimizer.step
  clip = float(opt_cfg.clip_grad_norm or 0.0)
  autocast = (torch.autocast(device_type=device, dtype=torch.bfloat16)
              if s.model.dtype == "bfloat16" else contextlib.nullcontext())
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

  def step() -> None:
    optimizer.zero_grad(set_to_none=True)
    with autocast:
      loss = loss_fn(*tensors)
    loss.backward()
    if clip > 0:
      nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt_step()
    sync()
  return model, step


def prepare(s: common.Setup, batch: dict[str, np.ndarray],
            seed: int = 0) -> tuple[dict[str, Any], dict[str, Callable[[], None]]]:
  """Builds and runs once (compiling, under torch.compile) the eager and the compiled train
  step: (facts, {"torch_eager": call, "torch_compile": call}). Both models' parameter
  counts are reported, and must agree."""
  import jax
  device = "cuda" if jax.devices()[0].platform == "gpu" and torch.cuda.is_available() else "cpu"
  jax_params = _jax_parameters(s, batch)
  info: dict[str, Any] = {"torch": torch.__version__, "device": device,
                          "threads": torch.get_num_threads(), "jax_parameters": jax_params}
  calls = {}
  for mode in ("eager", "compile"):
    model, step = _train_step(s, batch, mode == "compile", device, seed)
    torch_params = sum(p.numel() for p in model.parameters())
    if torch_params != jax_params:
      raise RuntimeError(f"PyTorch model has {torch_params:,} parameters, JAX model "
                         f"{jax_params:,}: the architectures differ")
    start = time.perf_counter()
    step()                        # under torch.compile: compiles forward, backward, Adam
    info[mode] = {"parameters": torch_params, "first_step_s": time.perf_counter() - start}
    calls[f"torch_{mode}"] = step
  return info, calls


def summarize(info: dict[str, Any], times: dict[str, list[float]], jax_result: dict[str, Any],
              tokens: int) -> dict[str, Any]:
  out = {**info, "ratios": {}}
  for mode in ("eager", "compile"):
    stats = common.stats_ms(times[f"torch_{mode}"])
    out[mode] = {**info[mode], "step_time_ms": stats,
                 "tokens_per_sec": tokens / (stats["median"] / 1000.0)}
    out["ratios"][f"jax_vs_torch_{mode}"] = (jax_result["tokens_per_sec"]
                                             / out[mode]["tokens_per_sec"])
  return out


def table_rows(compare: dict[str, Any]) -> list[tuple[str, str]]:
  rows = []
  for mode in ("eager", "compile"):
    r = compare[mode]
    rows.append((f"torch {mode}", f"{common.fmt_ms(r['step_time_ms'])}, "
                                  f"{r['tokens_per_sec']:,.0f} tokens/s, first step "
                                  f"{r['first_step_s']:.1f} s"))
  ratios = compare["ratios"]
  rows.append(("parameters", f"{compare['jax_parameters']:,} JAX, "
                             f"{compare['eager']['parameters']:,} PyTorch"))
  rows.append(("jax / torch tokens/s", f"{ratios['jax_vs_torch_eager']:.2f}x eager, "
                                       f"{ratios['jax_vs_torch_compile']:.2f}x torch.compile "
                                       f"(torch {compare['torch']}, {compare['threads']} "
                                       f"threads, {compare['device']})"))
  return rows
