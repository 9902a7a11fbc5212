"""Bad inputs that need a real process (issue 16): a second trainer on a locked workdir, a
checkpoint write that fails mid-run, a full disk, a loss made NaN by the learning rate, a
config file that fails to load, and the real `train.py`. Each ends with exit status 2 and one
line on stderr, and changes nothing saved before. The in-process cases: tests/test_bad_inputs.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from cli_helpers import ROOT, finish, start
from test_bad_inputs import run_user_error, snapshot
from test_training import tiny_run_config

from transformer_jax.training import loop

_HOLDER = """
import sys, time
from transformer_jax.training.workdir_lock import WorkdirLock
with WorkdirLock(sys.argv[1]):
  print("locked", flush=True)
  time.sleep(300)
"""


def test_a_second_trainer_is_refused_and_a_killed_ones_lock_does_not_block(tmp_path, capsys):
  workdir = str(tmp_path / "w")
  holder = start("-c", _HOLDER, workdir)
  try:
    assert holder.stdout.readline().strip() == "locked"
    status, lines = run_user_error(lambda: loop.train_and_evaluate(tiny_run_config(), workdir),
                                   capsys)
    assert status == 2 and len(lines) == 1
    assert "in use by another trainer" in lines[0] and f"PID {holder.pid}" in lines[0]
    assert "host " in lines[0]
    assert snapshot(workdir) == {}
  finally:
    holder.send_signal(signal.SIGKILL)     # dies holding the lock
    holder.wait()
  from transformer_jax.training.workdir_lock import WorkdirLock
  with WorkdirLock(workdir):               # the kernel released it
    pass


_READ_ONLY_AFTER_FIRST_SAVE = """
import errno, os, runpy, sys
real_rename = os.rename
def rename(src, dst, *args, **kwargs):
  # Checkpoint 2 commits; from step 4 on the file system refuses (as a read-only remount).
  if "/checkpoints/" in str(dst) and not str(dst).split("/checkpoints/")[1].startswith("2"):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dst))
  return real_rename(src, dst, *args, **kwargs)
os.rename = rename
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path(os.path.join({root!r}, "train.py"), run_name="__main__")
"""

TINY_FLAGS = [
    "--config.num_train_steps=6", "--config.log_every_steps=2", "--config.eval_every_steps=100",
    "--config.checkpoint_every_steps=2", "--config.batch_size=8", "--config.data.max_length=4",
    "--config.eval.examples=4", "--config.eval.batch_size=4", "--config.model.d_model=16",
    "--config.model.num_heads=2", "--config.model.d_ff=32",
    "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
    "--config.model.max_len=16", "--config.optimizer.warmup_steps=2",
]


def test_a_checkpoint_write_failure_ends_the_run_with_one_line(tmp_path):
  """No hang: the run ends within 60 s, says why in one line, checkpoint 2 is intact."""
  workdir = str(tmp_path / "w")
  script = _READ_ONLY_AFTER_FIRST_SAVE.replace("{root!r}", repr(ROOT))
  started = time.monotonic()
  process = subprocess.run([sys.executable, "-c", script, f"--workdir={workdir}", *TINY_FLAGS],
                           cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": ROOT})
  assert time.monotonic() - started < 60
  assert process.returncode == 2, process.stderr[-3000:]
  errors_ = [line for line in process.stderr.splitlines() if line.startswith("error:")]
  assert len(errors_) == 1 and "cannot write checkpoint to" in errors_[0]
  assert "read-only file system" in errors_[0]
  assert process.stderr.splitlines()[-1] == errors_[0]     # nothing after it
  assert "Traceback" not in process.stderr and "\r" not in process.stderr
  assert "2" in os.listdir(os.path.join(workdir, "checkpoints"))
  from transformer_jax.checkpoint import read_record
  assert read_record(os.path.join(workdir, "checkpoints", "2")).step == 2


@pytest.fixture
def small_disk(tmp_path):
  """An 8 MiB tmpfs the test can fill. Needs the right to mount (root, as on this project's
  machines and CI); skipped elsewhere."""
  mount_point = tmp_path / "small_disk"
  mount_point.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs",
                            str(mount_point)], capture_output=True)
  if mounted.returncode != 0:
    pytest.skip("cannot mount a small tmpfs here (needs root)")
  try:
    yield str(mount_point)
  finally:
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_disk_during_a_save_ends_the_run_with_one_line(small_disk):
  """Orbax/TensorStore report ENOSPC as ValueError("RESOURCE_EXHAUSTED ... [os_error_code=
  '28']") from several threads: still one line, status 2, the earlier checkpoint intact.
  Deterministic: a first run saves checkpoint 2; then the disk is filled to 64 KiB free (a
  tiny-model checkpoint takes about 430 KiB) and the same run resumes towards step 6."""
  workdir = os.path.join(small_disk, "w")
  command = [sys.executable, "train.py", f"--workdir={workdir}", *TINY_FLAGS]
  first = subprocess.run([*command, "--config.num_train_steps=2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
  assert first.returncode == 0, first.stderr[-3000:]
  disk = os.statvfs(small_disk)
  with open(os.path.join(small_disk, "filler"), "wb") as filler:
    filler.write(b"\0" * (disk.f_bavail * disk.f_frsize - 64 * 1024))
  process = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": ROOT})
  assert process.returncode == 2, process.stderr[-3000:]
  errors_ = [line for line in process.stderr.splitlines() if line.startswith("error:")]
  assert len(errors_) == 1 and "no space left on device" in errors_[0], process.stderr[-3000:]
  assert process.stderr.splitlines()[-1] == errors_[0], process.stderr[-3000:]
  assert "Traceback" not in process.stderr and "Event loop is closed" not in process.stderr
  steps = [int(name) for name in os.listdir(os.path.join(workdir, "checkpoints"))
           if name.isdigit()]
  from transformer_jax.checkpoint import read_record
  assert steps == [2], steps          # the save at step 4 failed; checkpoint 2 is untouched
  assert read_record(os.path.join(workdir, "checkpoints", "2")).step == 2


def test_a_learning_rate_that_makes_the_loss_nan_is_a_user_error(tmp_path):
  workdir = str(tmp_path / "w")
  status, output = finish(start("train.py", f"--workdir={workdir}", *TINY_FLAGS,
                                "--config.optimizer.learning_rate=1e38"))
  errors_ = [line for line in output.splitlines() if line.startswith("error:")]
  assert status == 2 and len(errors_) == 1 and "Traceback" not in output
  assert "non-finite loss" in errors_[0] and "--config.optimizer.learning_rate" in errors_[0]


@pytest.mark.parametrize("body, culprit", [
    ("def get_config(:\n  return None\n", ":1: invalid syntax"),
    ("import ml_collections\n\ndef get_config():\n  return no_such_name\n",
     ":4: NameError: name 'no_such_name' is not defined"),
])
def test_a_config_file_that_fails_to_load_is_named_with_its_line(tmp_path, body, culprit):
  path = tmp_path / "broken.py"
  path.write_text(body)
  status, output = finish(start("train.py", f"--config={path}", f"--workdir={tmp_path / 'w'}"))
  assert status == 2 and "Traceback" not in output
  assert output.strip().splitlines() == [output.strip()] and output.startswith("error: ")
  assert f"{path}{culprit}" in output
  assert not os.path.exists(tmp_path / "w")


_WRITE_REFUSED = """
import errno
from transformer_jax import errors
def main(argv):
  raise OSError(errno.ENOSPC, "No space left on device", "W/metrics.jsonl")
errors.run(main)
"""


def test_a_write_the_file_system_refuses_outside_a_checkpoint_is_one_line():
  """A full disk while metrics, tokenizers or outputs are written (not only checkpoints)."""
  status, output = finish(start("-c", _WRITE_REFUSED))
  assert status == 2 and "Traceback" not in output
  assert output.strip().splitlines() == [
      "error: W/metrics.jsonl: no space left on device (free space or choose another "
      "directory; a training run resumes from its last checkpoint)"]


def test_write_failures_are_recognised_in_every_form_orbax_gives():
  from transformer_jax.checkpoint.writing import write_failure_reason
  tensorstore = ValueError('RESOURCE_EXHAUSTED: Error writing "params.x/0" in OCDBT database '
                           "at local file \"/w/checkpoints/4.orbax-checkpoint-tmp/\": Failed to "
                           "write 562396 bytes to file 6: No space left on device "
                           "[os_error_code='28']")
  assert write_failure_reason(tensorstore) == "no space left on device"
  try:
    try:
      raise OSError(30, "Read-only file system")
    except OSError as e:
      raise RuntimeError("background save failed") from e
  except RuntimeError as chained:
    assert write_failure_reason(chained) == "read-only file system"
  assert write_failure_reason(ValueError("shapes differ")) is None


def test_train_py_reports_a_user_error_in_one_line(tmp_path):
  workdir = str(tmp_path / "w")
  status, output = finish(start("train.py", f"--workdir={workdir}", "--config.batch_size=0"))
  assert status == 2
  assert output.strip().splitlines() == ["error: config.batch_size=0: must be a positive "
                                         "integer"]
  assert not os.path.exists(os.path.join(workdir, "vocab.json"))
  status, output = finish(start("train.py", f"--workdir={workdir}", "--config=nowhere.py"))
  assert status == 2 and output.strip() == "error: --config=nowhere.py: no such file"
