"""Project commands as subprocesses, for the GPU measurements (benchmarks/gpu_measurements.py):
each one's JSON (its last stdout line) or why there is none, its wall time and any attention
fallback it warned of, under a limit per command and a budget for the whole run."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any


@dataclasses.dataclass
class Runner:
  """timeout_s: the limit of one command; budget_s: no command starts once the run has taken
  that long, and none runs past it by more than 30 s (0: no budget)."""
  timeout_s: int
  budget_s: int = 0
  started: float = dataclasses.field(default_factory=time.perf_counter)

  def module(self, args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """`python -m <args> --json`: its JSON, or why there is none."""
    return self.command([sys.executable, "-m", *args, "--json"], env=env)

  def command(self, command: list[str], parse_json: bool = True,
              env: dict[str, str] | None = None) -> dict[str, Any]:
    start = time.perf_counter()
    timeout = self.timeout_s
    if self.budget_s:
      left = self.budget_s - (start - self.started)
      if left <= 0:
        return {"command": " ".join(command[1:]), "skipped": f"--budget_s={self.budget_s} spent"}
      timeout = min(timeout, max(30, int(left)))
    try:
      proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env=environment(env))
    except subprocess.TimeoutExpired:
      return {"command": " ".join(command[1:]), "error": f"timed out after {timeout} s"}
    entry: dict[str, Any] = {"command": " ".join(command[1:]), "status": proc.returncode,
                             **({"env": env} if env else {}),
                             "wall_s": round(time.perf_counter() - start, 1)}
    # A kernel that cannot run falls back to 'xla' with a warning: say so beside the number.
    fallbacks = sorted({line.strip() for line in proc.stderr.splitlines()
                        if "falls back" in line})
    if fallbacks:
      entry["fallbacks"] = fallbacks
    if not parse_json:
      if proc.returncode:
        entry["error"] = "\n".join(proc.stderr.strip().splitlines()[-5:])
      return entry
    lines = proc.stdout.strip().splitlines()
    try:
      entry["result"] = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
      entry["error"] = "\n".join(proc.stderr.strip().splitlines()[-5:])
    return entry


def environment(extra: dict[str, str] | None) -> dict[str, str]:
  """This process's environment with `extra`; XLA_FLAGS are added to those already set."""
  env = {**os.environ, **(extra or {})}
  if extra and "XLA_FLAGS" in extra and os.environ.get("XLA_FLAGS"):
    env["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {extra['XLA_FLAGS']}"
  return env
