"""Orbax checkpoints in W/checkpoints/<step>/ with two items: `params` (enough for
prediction) and `train` (step, optimizer state, RNG). Saves are asynchronous and Orbax
commits each step directory atomically."""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from transformer_jax.training.state import TrainState


class Checkpointer:
  def __init__(self, directory: str, keep: int = 3):
    self.directory = os.path.abspath(directory)
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, state: TrainState, force: bool = False) -> bool:
    step = int(jax.device_get(state.step))
    train = {"step": state.step, "opt_state": state.opt_state, "rng": state.rng}
    return self.manager.save(step, force=force, args=ocp.args.Composite(
        params=ocp.args.StandardSave(state.params), train=ocp.args.StandardSave(train)))

  def restore(self, abstract_state: TrainState, step: int | None = None) -> TrainState:
    step = self.latest_step() if step is None else step
    train = {"step": abstract_state.step, "opt_state": abstract_state.opt_state,
             "rng": abstract_state.rng}
    restored = self.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_state.params),
        train=ocp.args.StandardRestore(train)))
    t = restored["train"]
    return TrainState(step=t["step"], params=restored["params"], opt_state=t["opt_state"],
                      rng=t["rng"])

  def restore_params(self, abstract_params: Any, step: int | None = None) -> Any:
    step = self.latest_step() if step is None else step
    restored = self.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_params)))
    return restored["params"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
