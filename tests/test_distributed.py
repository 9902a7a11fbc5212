"""Multi-host training: two processes on this machine (4 CPU devices each, jax.distributed with
a coordinator on 127.0.0.1) train together through train.py and agree with one process that
has all 8 devices."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

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
