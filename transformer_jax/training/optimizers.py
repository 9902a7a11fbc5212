"""Learning-rate schedules and the optimizer, from Optax, chosen by config."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax

from transformer_jax.errors import UserError

SCHEDULES = ("rsqrt", "warmup_cosine", "constant")
OPTIMIZERS = ("adam", "adamw")


def paper_schedule(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
  """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (paper eq. 3), with
  step counted from 1 (Optax counts updates from 0)."""
  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return scale * d_model ** -0.5 * jnp.minimum(step ** -0.5, step * warmup_steps ** -1.5)
  return schedule


def make_schedule(cfg: Any, d_model: int, num_train_steps: int) -> optax.Schedule:
  """cfg: the `optimizer` config group. `learning_rate` is the peak rate for every schedule;
  for "rsqrt" a value <= 0 means the paper's own peak d_model^-0.5 * warmup^-0.5."""
  name, peak, warmup = cfg.schedule, float(cfg.learning_rate), int(cfg.warmup_steps)
  if name not in SCHEDULES:
    raise UserError(f"optimizer.schedule={name!r}: must be one of {SCHEDULES}")
  if warmup < 0:
    raise UserError(f"optimizer.warmup_steps={warmup}: must be >= 0")
  if name == "rsqrt":
    if warmup < 1:
      raise UserError("optimizer.warmup_steps must be >= 1 for the rsqrt schedule")
    scale = 1.0 if peak <= 0 else peak / (d_model ** -0.5 * warmup ** -0.5)
    return paper_schedule(d_model, warmup, scale)
  if peak <= 0:
    raise UserError(f"optimizer.learning_rate={peak}: must be > 0 for schedule {name!r}")
  if name == "constant":
    if warmup == 0:
      return optax.constant_schedule(peak)
    return optax.linear_schedule(0.0, peak, warmup)  # Holds `peak` after warmup.
  return optax.warmup_cosine_decay_schedule(0.0, peak, max(warmup, 1),
                                            max(num_train_steps, warmup + 1))


def make_optimizer(cfg: Any, schedule: optax.Schedule) -> optax.GradientTransformation:
  """Adam(b1, b2, eps) as in the paper (0.9, 0.98, 1e-9), optional AdamW decay and global
  gradient-norm clipping."""
  if cfg.name not in OPTIMIZERS:
    raise UserError(f"optimizer.name={cfg.name!r}: must be one of {OPTIMIZERS}")
  if cfg.name == "adamw":
    tx = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                     weight_decay=cfg.weight_decay)
  else:
    tx = optax.adam(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
  if cfg.clip_grad_norm and cfg.clip_grad_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_grad_norm), tx)
  return tx
