"""Learning-rate schedules and the optimizer, from Optax, chosen by config."""

from __future__ import annotations

from typing import Any, Sequence

import flax.core.meta
import jax
import jax.numpy as jnp
import optax

from transformer_jax.options import OptimizerOptions


def paper_schedule(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
  """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (paper eq. 3), with
  step counted from 1 (Optax counts updates from 0)."""
  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return scale * d_model ** -0.5 * jnp.minimum(step ** -0.5, step * warmup_steps ** -1.5)
  return schedule


def make_schedule(cfg: OptimizerOptions, d_model: int,
                  num_train_steps: int) -> optax.Schedule:
  """`learning_rate` is the peak rate for every schedule; for "rsqrt" a value <= 0 means the
  paper's own peak d_model^-0.5 * warmup^-0.5 (the options are validated by their class)."""
  name, peak, warmup = cfg.schedule, float(cfg.learning_rate), int(cfg.warmup_steps)
  if name == "rsqrt":
    scale = 1.0 if peak <= 0 else peak / (d_model ** -0.5 * warmup ** -0.5)
    return paper_schedule(d_model, warmup, scale)
  if name == "constant":
    if warmup == 0:
      return optax.constant_schedule(peak)
    return optax.linear_schedule(0.0, peak, warmup)  # Holds `peak` after warmup.
  return optax.warmup_cosine_decay_schedule(0.0, peak, max(warmup, 1),
                                            max(num_train_steps, warmup + 1),
                                            end_value=float(cfg.end_learning_rate))


# The hidden matrices Muon orthogonalises, by module: each kernel's reduction (input) and
# output axes, counted from its end (a scanned stack's layer axis and the fused projection's
# q/k/v axis come before them: each matrix of those is orthogonalised on its own).
_HIDDEN_MATRICES = {
    "query": (-3, (-2, -1)), "key": (-3, (-2, -1)), "value": (-3, (-2, -1)),
    "qkv": (-4, (-2, -1)), "out": ((-3, -2), -1),
    "wi": (-2, -1), "wi_up": (-2, -1), "wo": (-2, -1)}


def muon_dimensions(params: Any) -> Any:
  """Per parameter: optax's MuonDimensionNumbers for the attention and feed-forward kernels
  of the layers, None (Adam) for the rest: embeddings, the output head, norms, biases."""
  def dimensions(path: Any, _: Any) -> Any:
    keys = [getattr(p, "key", None) for p in path]
    if keys[-1] == "kernel" and len(keys) > 1 and keys[-2] in _HIDDEN_MATRICES:
      reduction, output = _HIDDEN_MATRICES[keys[-2]]
      return optax.contrib.MuonDimensionNumbers(reduction, output)
    return None
  # A parameter still in its partitioning box (a sharded state's init) is one leaf.
  return jax.tree_util.tree_map_with_path(
      dimensions, params, is_leaf=lambda x: isinstance(x, flax.core.meta.AxisMetadata))


def _muon(cfg: OptimizerOptions, schedule: optax.Schedule) -> optax.GradientTransformation:
  """Muon (optax.contrib.muon: momentum `muon_momentum`, Nesterov, orthogonalised by
  Newton-Schulz) for the hidden matrices at `muon_learning_rate`, following `schedule`'s
  shape; Adam(b1, b2, eps; Nesterov, as optax's Muon gives it) for the rest at `schedule`, as
  the modded-nanogpt speedrun splits them. weight_decay decays the hidden matrices only
  (decaying the rest as well did not help SST-2: benchmarks/RESULTS.md)."""
  peak = float(cfg.learning_rate)
  ratio = cfg.muon_learning_rate / (peak if peak > 0 else float(schedule(cfg.warmup_steps - 1)))
  return optax.contrib.muon(
      lambda count: schedule(count) * ratio, beta=cfg.muon_momentum, eps=cfg.eps,
      ns_steps=cfg.muon_ns_steps,
      weight_decay=cfg.weight_decay, adam_b1=cfg.b1, adam_b2=cfg.b2,
      adam_learning_rate=schedule, muon_weight_dimension_numbers=muon_dimensions)


def make_optimizer(cfg: OptimizerOptions, schedule: optax.Schedule,
                   pretrained_modules: Sequence[str] = ()) -> optax.GradientTransformation:
  """Adam(b1, b2, eps) as in the paper (0.9, 0.98, 1e-9), AdamW, or Muon for the hidden
  matrices with Adam for the rest (`_muon`); optional weight decay and global
  gradient-norm clipping. The updates of `pretrained_modules` (top-level parameter modules
  carried over by init_from) are scaled by cfg.pretrained_rate_scale: a lower rate for a
  pretrained encoder than for its fresh head (ULMFiT's discriminative fine-tuning)."""
  if cfg.name == "muon":
    tx = _muon(cfg, schedule)
  elif cfg.name == "adamw":
    # decay_matrices_only: as GPT-2 and nanoGPT, no decay of biases and norm scales. A bias
    # can be a matrix here: an attention projection's is (heads, d_k).
    decayed = lambda path, p: p.ndim >= 2 and getattr(path[-1], "key", None) != "bias"
    mask = (lambda params: jax.tree_util.tree_map_with_path(decayed, params)
            ) if cfg.decay_matrices_only else None
    tx = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                     weight_decay=cfg.weight_decay, mask=mask)
  else:
    tx = optax.adam(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
  if cfg.clip_grad_norm and cfg.clip_grad_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_grad_norm), tx)
  if pretrained_modules and cfg.pretrained_rate_scale != 1:
    carried = frozenset(pretrained_modules)

    def labels(params: Any) -> Any:
      return {name: jax.tree_util.tree_map(
                  lambda _, label="pretrained" if name in carried else "fresh": label, tree)
              for name, tree in params.items()}
    tx = optax.chain(tx, optax.multi_transform(
        {"pretrained": optax.scale(cfg.pretrained_rate_scale), "fresh": optax.identity()},
        labels))
  return tx
