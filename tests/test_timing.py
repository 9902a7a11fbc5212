"""A run's time split (training/timing.py) and the persistent compilation cache of train.py."""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax
import jax.numpy as jnp
import pytest
from cli_helpers import finish, start
from test_cli import TINY_OVERRIDES

from transformer_jax.training import timing

P = timing.PREFIX


def _parts(split: dict[str, float]) -> dict[str, float]:
  """The seconds that make up the total."""
  return {k: v for k, v in split.items() if k.endswith("_s") and k != P + "total_s"}


def test_parts_add_up_to_the_total_and_nothing_is_counted_twice():
  clock = timing.RunClock()
  outer_started = time.perf_counter()
  with clock.measure("steps"):
    time.sleep(0.05)
    eval_started = time.perf_counter()
    with clock.measure("eval"):
      time.sleep(0.05)
      jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)(jnp.ones(7)).block_until_ready()  # compiles
    eval_wall = time.perf_counter() - eval_started
  outer_wall = time.perf_counter() - outer_started
  split = clock.split()

  assert sum(_parts(split).values()) == pytest.approx(split[P + "total_s"], abs=1e-6)
  assert split[P + "programs"] >= 1 and split[P + "compile_s"] > 0
  assert split[P + "steps_s"] >= 0.05 and split[P + "eval_s"] >= 0.05   # each its own time
  # The compile inside eval is in compile_s only; eval's time is not in steps_s.
  assert split[P + "eval_s"] + split[P + "compile_s"] <= eval_wall + 1e-6
  assert (split[P + "steps_s"] + split[P + "eval_s"] + split[P + "compile_s"]
          <= outer_wall + 1e-6)
  assert P + "startup_s" not in split              # not measured here: not reported


def test_a_split_taken_inside_open_phases_counts_their_time_so_far():
  """A run stopped inside its step loop (SIGTERM) writes its split there: the steps so far
  are steps, not `other`."""
  clock = timing.RunClock()
  with clock.measure("steps"):
    time.sleep(0.05)
    with clock.measure("checkpoint"):
      time.sleep(0.05)
      split = clock.split()
  assert split[P + "steps_s"] >= 0.05 and split[P + "checkpoint_s"] >= 0.05
  assert split[P + "other_s"] < 0.03
  assert sum(_parts(split).values()) == pytest.approx(split[P + "total_s"], abs=1e-6)


def test_the_command_start_counts_once():
  timing.command_started(time.perf_counter() - 1.0)
  first, second = timing.RunClock(), timing.RunClock()
  assert first.split()[P + "startup_s"] >= 1.0
  assert first.split()[P + "total_s"] >= 1.0
  assert P + "startup_s" not in second.split() and second.split()[P + "total_s"] < 1.0


def _time_line(workdir: str) -> dict[str, float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:   # the metrics hold no timing line
    assert not any("perf/time/" in line for line in f)
  with open(os.path.join(workdir, "time_split.json")) as f:
    return json.load(f)


def test_a_second_run_loads_every_program_from_the_compilation_cache(tmp_path):
  cache = str(tmp_path / "cache")
  runs = []
  for name in ("first", "second"):
    workdir = str(tmp_path / name)
    code, output = finish(start("train.py", *TINY_OVERRIDES, f"--workdir={workdir}",
                                f"--compilation_cache_dir={cache}"))
    assert code == 0, output
    assert output.strip().splitlines()[-1].startswith("time: ")   # the last line printed
    runs.append(_time_line(workdir))
  first, second = runs
  for split in runs:
    assert split["step"] == 4
    assert {P + f"{phase}_s" for phase in timing.PHASES} <= set(split)
    assert sum(_parts(split).values()) == pytest.approx(split[P + "total_s"], abs=1e-6)
    assert split[P + "startup_s"] > 0            # train.py marks the command's start
  assert first[P + "programs"] > 0 and first[P + "programs_from_cache"] == 0
  assert os.listdir(cache)
  assert second[P + "programs_from_cache"] == second[P + "programs"] == first[P + "programs"]
