"""The config groups of training from a model: `pretrain` (self-pretraining first,
training/recipe.py) and `lora` (adapters of init_from's model, lora.py). Part of the run
config's schema (options.py, which registers and re-exports them), kept apart for its size."""

from __future__ import annotations

import dataclasses

from transformer_jax.errors import UserError
from transformer_jax.option_checks import TOO_LONG_POLICIES, check_choice
from transformer_jax.option_checks import GroupOptions as _Options
from transformer_jax.option_checks import integer as _integer
from transformer_jax.option_checks import number as _number

# The self-pretraining stage's task (training/recipe.py): a masked LM or replaced-token
# detection; named here so that the schema needs no task import.
PRETRAIN_OBJECTIVES = ("mlm", "rtd")


@dataclasses.dataclass(frozen=True)
class PretrainOptions(_Options):
  """Self-pretraining (training/recipe.py; docs/pretraining.md): with `enabled`, `train.py`
  first trains the `objective`'s task ("mlm", or ELECTRA's replaced-token detection "rtd",
  its discriminator loss weighing `discriminator_weight` times the generator's) on the run's
  training text (plus the lines of `extra_text`) in W/pretrain, with its own vocabulary,
  steps, batch, rate, dropout, row length and too_long (0 or "": the run's), then
  fine-tunes from it in W. `mask_rate`: the share of tokens the model predicts."""
  enabled: bool = False
  objective: str = "mlm"
  discriminator_weight: float = 50.0
  num_train_steps: int = 2000
  batch_size: int = 0
  learning_rate: float = 0.0
  warmup_steps: int = 500
  mask_rate: float = 0.15
  vocab_size: int = 0
  extra_text: str = ""
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  max_length: int = 0
  too_long: str = ""

  def __post_init__(self) -> None:
    check_choice("pretrain.", "too_long", self.too_long, ("", *TOO_LONG_POLICIES))
    check_choice("pretrain.", "objective", self.objective, PRETRAIN_OBJECTIVES)
    _number("pretrain.", "discriminator_weight", self.discriminator_weight, lambda v: v > 0,
            "a number > 0")
    for name, low in (("num_train_steps", 1), ("batch_size", 0), ("warmup_steps", 0),
                      ("vocab_size", 0), ("max_length", 0)):
      _integer("pretrain.", name, getattr(self, name), low)
    _number("pretrain.", "learning_rate", self.learning_rate, lambda v: v >= 0,
            ">= 0 (0: the run's optimizer.learning_rate)")
    _number("pretrain.", "mask_rate", self.mask_rate, lambda v: 0 < v < 1, "in (0, 1)")
    for name in ("dropout_rate", "attention_dropout_rate"):
      _number("pretrain.", name, getattr(self, name), lambda v: 0 <= v < 1, "in [0, 1)")


# LoRA's targets (lora.py), named as the Llama-shaped families name their projections.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoraOptions(_Options):
  """LoRA of init_from's model (lora.py; docs/pretrained_models.md): with `rank` > 0 (0: off)
  each kernel of `targets` (--config.lora.targets=q_proj,v_proj) is W + alpha/rank * A B,
  W frozen, A and B trained; `dropout` on the adapters' input in training, as PEFT's."""
  rank: int = 0
  alpha: float = 16.0
  dropout: float = 0.0
  targets: tuple[str, ...] = LORA_TARGETS

  def __post_init__(self) -> None:
    _integer("lora.", "rank", self.rank, 0)
    _number("lora.", "alpha", self.alpha, lambda v: v > 0, "a number > 0")
    _number("lora.", "dropout", self.dropout, lambda v: 0 <= v < 1, "in [0, 1)")
    given = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets or ())
    names = tuple(n.strip() for item in given for n in str(item).split(",") if n.strip())
    if not names or not set(names) <= set(LORA_TARGETS):
      raise UserError(f"lora.targets={self.targets!r}: must be a non-empty subset of "
                      f"{LORA_TARGETS}")
    object.__setattr__(self, "targets", names)
