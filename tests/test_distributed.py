"""Multi-host training: two processes on this machine (4 CPU devices each, jax.distributed with
a coordinator on 127.0.0.1) train together through train.py and agree with one process that
has all 8 devices. Joining a cluster: once per process, and a user error after JAX started.
(The two-stage recipe and checkpoint averaging on 2 processes: tests/test_elastic.py.)"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import jax
import pytest

from transformer_jax import errors, sharding
from transformer_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 10
RUN_FLAGS = [
    f"--config.num_train_steps={STEPS}", "--config.log_every_steps=5",
    f"--config.eval_every_steps={STEPS}", f"--config.checkpoint_every_steps={STEPS}",
    "--config.batch_size=32", "--config.eval.examples=8", "--config.eval.batch_size=8",
    "--config.model.d_model=32", "--config.model.d_ff=64", "--config.model.num_heads=4",
    "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
    "--config.mesh.data=-1",
]


def _env(devices: int) -> dict[str, str]:
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                 os.environ.get("XLA_FLAGS", ""))
  return {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}",
          "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


def _start(workdir: str, devices: int, *extra: str) -> subprocess.Popen:
  return subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={workdir}", *RUN_FLAGS,
       *extra], cwd=ROOT, env=_env(devices), text=True, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT)


def _finish(process: subprocess.Popen) -> str:
  try:
    out, _ = process.communicate(timeout=300)
  except subprocess.TimeoutExpired:
    process.kill()
    out, _ = process.communicate()
  assert process.returncode == 0, out[-3000:]
  return out


def _metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_train_like_one(tmp_path):
  port = _free_port()
  shared = str(tmp_path / "two_processes")        # both hosts write to one (shared) workdir
  workers = [_start(shared, 4, "--config.distributed.initialize=True",
                    f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                    "--config.distributed.num_processes=2",
                    f"--config.distributed.process_id={i}") for i in range(2)]
  outputs = [_finish(w) for w in workers]
  single = str(tmp_path / "one_process")
  _finish(_start(single, 8))

  assert "mesh: {'data': 8, 'fsdp': 1, 'tensor': 1} over 8 cpu devices" in outputs[0]
  two, one = _metrics(shared), _metrics(single)
  assert [m["step"] for m in two] == [m["step"] for m in one]   # process 0 alone writes
  for a, b in zip(two, one):
    for key in ("train/loss", "train/grad_norm", "eval/loss", "eval/accuracy"):
      if key in b:
        assert a[key] == pytest.approx(b[key], rel=1e-5), (a["step"], key)
  # Both hosts wrote the checkpoint together: one complete step directory.
  assert os.listdir(os.path.join(shared, "checkpoints")) == [str(STEPS)]
  assert "final:" in outputs[0] and "final:" not in outputs[1]  # only process 0 reports


def test_joining_a_cluster_after_jax_started_is_one_error_line(capsys):
  """JAX joins a cluster only before its backend starts: a caller that used JAX first gets
  the user error (one line, status 2) naming the fix, not JAX's RuntimeError."""
  jax.devices()     # the backend is up, as it is in any process that computed something
  join = lambda: sharding.initialize_distributed(f"127.0.0.1:{_free_port()}", 2, 0)
  fix = r"call transformer_jax\.training\.loop\.start_distributed\(config\) before any other JAX"
  with pytest.raises(UserError, match=f"used JAX before joining the cluster.*{fix}") as caught:
    join()
  assert isinstance(caught.value.__cause__, RuntimeError)
  with pytest.raises(SystemExit) as ended:
    errors.user_errors(join)()
  assert ended.value.code == errors.EXIT_STATUS
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: config.distributed.initialize=True")


def test_a_second_start_joins_nothing_and_a_different_cluster_is_refused(monkeypatch):
  """Once a process is in a cluster (a recipe's first stage started it), starting it again
  is a no-op for the same cluster and a user error for another one."""
  def must_not_run(**kwargs):
    raise AssertionError(f"jax.distributed.initialize called again with {kwargs}")
  monkeypatch.setattr(jax.distributed, "initialize", must_not_run)
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  sharding.initialize_distributed(f"127.0.0.1:{_free_port()}", jax.process_count(),
                                  jax.process_index())
  sharding.initialize_distributed()          # the cluster read from the environment: as is
  with pytest.raises(UserError, match=r"already joined a cluster as process 0 of 1, not 1 of 3"):
    sharding.initialize_distributed("127.0.0.1:1", 3, 1)
