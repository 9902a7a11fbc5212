"""Runs that die: `python train.py` killed with SIGKILL right after a checkpoint, or stopped
with SIGTERM, then resumed with the same command, must end bitwise where a run straight
through ends. Runs are subprocesses of the repository's train.py (tests/gated_train.py
holds one at a known step, so nothing races), on a tiny model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from cli_helpers import TIMEOUT, start
from cli_helpers import finish as _finish

from transformer_jax import checkpoint
from transformer_jax.predict import Predictor

STEPS = 12
TINY = [
    f"--config.num_train_steps={STEPS}", "--config.log_every_steps=2",
    "--config.checkpoint_every_steps=4", "--config.eval_every_steps=100",
    "--config.keep_checkpoints=3", "--config.batch_size=8", "--config.data.max_length=4",
    "--config.eval.examples=4", "--config.eval.batch_size=4", "--config.decode.beam_size=1", "--config.model.d_model=32",
    "--config.model.num_heads=2",
    "--config.model.d_ff=64", "--config.model.num_encoder_layers=1",
    "--config.model.num_decoder_layers=1", "--config.model.max_len=16",
    "--config.model.dropout_rate=0.1",   # Dropout keys must continue too.
    "--config.optimizer.warmup_steps=4",
]

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _start(script: str, workdir, *extra: str, env: dict | None = None) -> subprocess.Popen:
  return start(script, *TINY, f"--workdir={workdir}", *extra, env=env)


def _wait_for(process: subprocess.Popen, *paths) -> None:
  """Polls until every path exists; fails if the process ends first."""
  deadline = time.monotonic() + TIMEOUT
  while not all(os.path.exists(p) for p in paths):
    if process.poll() is not None:
      pytest.fail(f"process ended (status {process.returncode}) before {paths}:\n"
                  f"{process.communicate()[0]}")
    if time.monotonic() > deadline:
      process.kill()
      pytest.fail(f"timed out waiting for {paths}")
    time.sleep(0.05)


def _gated(workdir, gate_after: int, open_file=None) -> subprocess.Popen:
  env = {"GATE_AFTER": str(gate_after), "GATE_FILE": str(workdir) + ".gate"}
  if open_file:
    env["OPEN_FILE"] = str(open_file)
  return _start(os.path.join("tests", "gated_train.py"), workdir, env=env)


def _metrics(workdir) -> list[dict]:
  """metrics.jsonl without the timing-dependent perf/* values."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    lines = [{k: v for k, v in json.loads(l).items() if not k.startswith("perf/")} for l in f]
  return [line for line in lines if len(line) > 1]


def _final_arrays(workdir) -> dict:
  """The last checkpoint's params, optimizer state, step and RNG as saved, and its data
  iterator state."""
  path = os.path.join(workdir, checkpoint.CHECKPOINT_DIR, str(STEPS))
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    return dict(checkpointer.restore(path, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(), train=ocp.args.StandardRestore(),
        data=ocp.args.JsonRestore())))


def _assert_same_run(workdir, straight) -> None:
  actual, expected = _final_arrays(workdir), _final_arrays(straight)
  assert actual["data"] == expected["data"] == {"next_index": STEPS}
  for item in ("params", "train"):
    leaves_a, tree_a = jax.tree_util.tree_flatten(actual[item])
    leaves_e, tree_e = jax.tree_util.tree_flatten(expected[item])
    assert tree_a == tree_e
    for a, e in zip(leaves_a, leaves_e):                 # Bitwise.
      assert np.asarray(a).tobytes() == np.asarray(e).tobytes()
  assert _metrics(workdir) == _metrics(straight)


class _Background:
  """A run started now and awaited when first needed (it overlaps the test's own runs)."""

  def __init__(self, workdir: str):
    self.workdir, self._process, self._done = workdir, _start("train.py", workdir), False

  def __call__(self) -> str:
    if not self._done:
      code, output = _finish(self._process)
      assert code == 0, output
      self._done = True
    return self.workdir


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> _Background:
  """The reference: STEPS steps in one go, without interruption."""
  return _Background(str(tmp_path_factory.mktemp("straight") / "run"))


def test_sigkill_after_a_checkpoint_then_resume_is_exact(straight, tmp_path):
  workdir = str(tmp_path / "killed")
  # Steps 1-7 run; step 4 is checkpointed and step 6 logged; the batch of step 8 waits.
  process = _gated(workdir, gate_after=7)
  _wait_for(process, workdir + ".gate", os.path.join(workdir, "checkpoints", "4"))
  process.send_signal(signal.SIGKILL)
  _finish(process)
  assert checkpoint.checkpoint_steps(os.path.join(workdir, "checkpoints")) == [4]
  assert [l["step"] for l in _metrics(workdir)] == [2, 4, 6]   # 6 is lost work, redone.

  code, output = _finish(_start("train.py", workdir))
  assert code == 0, output
  assert "resumed from step 4" in output
  _assert_same_run(workdir, straight())


def test_sigterm_stops_with_a_checkpoint_and_resume_is_exact(straight, tmp_path):
  workdir = str(tmp_path / "preempted")
  open_file = tmp_path / "open"
  process = _gated(workdir, gate_after=5, open_file=open_file)   # Waits before step 6.
  _wait_for(process, workdir + ".gate")
  process.send_signal(signal.SIGTERM)
  signalled = time.monotonic()
  open_file.touch()                      # Step 6 runs, then the loop sees the signal.
  code, output = _finish(process)
  seconds = time.monotonic() - signalled
  assert code == 0, output
  assert "SIGTERM received: stopped after step 6" in output
  assert seconds < 30, f"took {seconds:.1f} s to stop"
  assert checkpoint.checkpoint_steps(os.path.join(workdir, "checkpoints")) == [4, 6]
  assert "eval/loss" not in open(os.path.join(workdir, "metrics.jsonl")).read()

  code, output = _finish(_start("train.py", workdir))
  assert code == 0, output
  assert "resumed from step 6" in output
  _assert_same_run(workdir, straight())


def test_incompatible_config_is_refused_with_the_fields(straight):
  straight = straight()
  config_before = open(os.path.join(straight, "config.json")).read()
  steps_before = checkpoint.checkpoint_steps(os.path.join(straight, "checkpoints"))
  code, output = _finish(_start("train.py", straight, "--config.model.d_model=64",
                                "--config.model.d_ff=128"))
  assert code != 0
  assert "cannot resume from" in output and f"checkpoints{os.sep}{STEPS}" in output
  assert "model.d_model: 32 -> 64" in output and "model.d_ff: 64 -> 128" in output
  assert "Traceback" not in output
  assert open(os.path.join(straight, "config.json")).read() == config_before
  assert checkpoint.checkpoint_steps(os.path.join(straight, "checkpoints")) == steps_before


def test_export_and_average_load_into_predict(straight, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(straight(), workdir)
  code, output = _finish(start("-m", "transformer_jax.export", f"--workdir={workdir}",
                               "--average=2"))
  assert code == 0, output
  averaged = os.path.join(workdir, "exports", f"step_{STEPS}_avg2")
  assert os.path.isdir(averaged)
  # Evaluation uses exports too: by default the newest (the average); a given checkpoint
  # evaluates to what training logged for it.
  eval_average = _start("train.py", workdir, "--eval_only")
  eval_last = _start("train.py", workdir, "--eval_only",
                     f"--checkpoint={os.path.join(workdir, 'checkpoints', str(STEPS))}")

  predictor = Predictor(workdir)                # The average, not the checkpoint of its step.
  assert predictor.path == averaged and predictor.step == STEPS
  checkpoints = [Predictor(checkpoint_path=os.path.join(workdir, "checkpoints", str(s)))
                 for s in (STEPS - 4, STEPS)]
  mean = jax.tree_util.tree_map(lambda a, b: (np.asarray(a) + np.asarray(b)) / 2,
                                checkpoints[0].params, checkpoints[1].params)
  for a, e in zip(jax.tree_util.tree_leaves(predictor.params), jax.tree_util.tree_leaves(mean)):
    assert np.asarray(a).tobytes() == np.asarray(e, np.float32).tobytes()
  lines = ["1 2 3", "4 0", "7"]
  assert len(predictor.predict_lines(lines)) == 3

  code, output = _finish(eval_average)
  assert code == 0, output
  average_of = f"the average of steps [{STEPS - 4}, {STEPS}]"
  assert f"evaluated {averaged} (step {STEPS}, {average_of})" in output
  code, output = _finish(eval_last)
  assert code == 0, output
  logged = [l for l in _metrics(workdir) if "eval/loss" in l][-1]
  assert logged["step"] == STEPS
  loss, accuracy = logged["eval/loss"], logged["eval/accuracy"]
  assert f"eval/loss={loss:.4f}, eval/accuracy={accuracy:.4f}" in output

  # An export of one checkpoint predicts exactly what that checkpoint does, without the
  # workdir (its config and tokenizer are inside).
  single = str(tmp_path / "elsewhere" / "model")
  checkpoint.write_average(os.path.join(workdir, "checkpoints"), [STEPS], single)
  shutil.rmtree(workdir)
  exported = Predictor(checkpoint_path=single)
  assert exported.predict_lines(lines) == checkpoints[1].predict_lines(lines)
