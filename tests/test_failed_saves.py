"""Every way a command can end after a save fails keeps the contract: exactly one `error:`
line, the last on stderr, exit status 2, no traceback; and the checkpoint before the failed
save restores, and is what predict loads. Covered: a failed save, SIGTERM during a save, a
non-finite stop while a save is in flight, a full disk at the final save, at averaging, and
in the export of a parameter snapshot.

The fault is in the save, not in its timing (tests/save_fault.py): the disk refuses the
save's config item while its array writes are still in flight. A command that exits without
first ending Orbax's work on that save fails here every time: a traceback from Orbax's commit
thread ("cannot schedule new futures after ... shutdown") follows its error line.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from cli_helpers import ROOT
from test_bad_inputs_processes import TINY_FLAGS

from transformer_jax import checkpoint


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """One compilation cache for the module's runs: only the first compiles."""
  return f"--compilation_cache_dir={tmp_path_factory.mktemp('compiled')}"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=300, env={**os.environ, **env, "PYTHONPATH": ROOT})


def _with_fault(place: str, *args: str, **env: str) -> subprocess.CompletedProcess:
  return _run(os.path.join("tests", "save_fault.py"), place, *args, **env)


def _assert_one_line(process: subprocess.CompletedProcess, says: str) -> None:
  lines = process.stderr.splitlines()
  errors = [line for line in lines if line.startswith("error:")]
  assert process.returncode == 2, process.stderr[-3000:]
  assert len(errors) == 1 and says in errors[0], process.stderr[-3000:]
  assert lines[-1] == errors[0], process.stderr[-3000:]      # nothing after it
  assert "Traceback" not in process.stderr, process.stderr[-3000:]


def _assert_restores(workdir: str, step: int) -> None:
  """Checkpoint `step` is the newest, restores, and is the model predict picks."""
  path = os.path.join(workdir, "checkpoints", str(step))
  assert checkpoint.checkpoint_steps(os.path.join(workdir, "checkpoints"))[-1] == step
  assert checkpoint.models(workdir)[0] == path
  assert checkpoint.read_record(path).step == step
  params = checkpoint.restore_params(path)
  assert all(np.isfinite(leaf).all() for leaf in jax.tree_util.tree_leaves(params))


# name: (the failed save, environment, extra flags, what the one line says, newest step kept)
EXITS = {
    "failed_save": ("/checkpoints/4.", {}, [], "cannot write checkpoint to", 2),
    "sigterm_during_a_save": ("/checkpoints/4.", {"SAVE_FAULT_SIGTERM": "1"}, [],
                              "cannot write checkpoint to", 2),
    "nonfinite_stop_while_a_save_is_in_flight": ("/checkpoints/4.", {"SAVE_FAULT_NAN_AT": "5"},
                                                 [], "non-finite loss", 2),
    "full_disk_at_the_final_save": ("/checkpoints/6.", {}, [], "cannot write checkpoint to", 4),
    "full_disk_at_averaging": ("/exports/", {}, ["--config.average_checkpoints=2"],
                               "cannot write parameter snapshot", 6),
}


@pytest.mark.parametrize("ending", EXITS)
def test_a_run_that_ends_after_a_failed_save_says_one_line(tmp_path, cache, ending):
  place, env, flags, says, kept = EXITS[ending]
  workdir = str(tmp_path / "w")
  process = _with_fault(place, "train.py", f"--workdir={workdir}", *TINY_FLAGS, *flags, cache,
                        **env)
  _assert_one_line(process, says)
  _assert_restores(workdir, kept)
  if ending == "sigterm_during_a_save":     # stopped at the step after the signal
    assert "step 5/6" in process.stderr and "step 6/6" not in process.stderr
  if ending == "nonfinite_stop_while_a_save_is_in_flight":   # said, before the error line
    assert "cannot write checkpoint to" in process.stderr
  if ending == "full_disk_at_averaging":
    assert not os.path.exists(os.path.join(workdir, "exports", "step_6_avg2"))


def test_an_export_whose_snapshot_fails_says_one_line(tmp_path, cache):
  workdir = str(tmp_path / "w")
  trained = _run("train.py", f"--workdir={workdir}", *TINY_FLAGS, cache)
  assert trained.returncode == 0, trained.stderr[-3000:]
  process = _with_fault("/exports/", "-m", "transformer_jax.export", f"--workdir={workdir}",
                        "--average=2")
  _assert_one_line(process, "cannot write parameter snapshot")
  assert not os.path.exists(os.path.join(workdir, "exports", "step_6_avg2"))
  _assert_restores(workdir, 6)
