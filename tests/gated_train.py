"""`python tests/gated_train.py [train.py flags]`: train.py with a gate in its training data,
so that a test can stop a run at a known step without racing it.

After handing out GATE_AFTER batches, the next request for a batch creates the file
GATE_FILE and then waits until the file OPEN_FILE exists (forever if OPEN_FILE is unset).
Steps 1..GATE_AFTER have then been dispatched and step GATE_AFTER + 1 has not started.
"""

import os
import sys
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]

from absl import app  # noqa: E402
from data_wrappers import BatchesWrapper, SourceWrapper  # noqa: E402

import train  # noqa: E402  (defines train.py's flags)
from transformer_jax.training import experiment  # noqa: E402

GATE_AFTER = int(os.environ["GATE_AFTER"])
GATE_FILE = os.environ["GATE_FILE"]
OPEN_FILE = os.environ.get("OPEN_FILE")


class GatedBatches(BatchesWrapper):
  handed_out = 0

  def __next__(self):
    if self.handed_out == GATE_AFTER:
      open(GATE_FILE, "w").close()
      while OPEN_FILE is None or not os.path.exists(OPEN_FILE):
        time.sleep(0.02)
    self.handed_out += 1
    return next(self.batches)


_make_source = experiment.make_source
experiment.make_source = lambda *args: SourceWrapper(_make_source(*args), GatedBatches)

if __name__ == "__main__":
  app.run(train.main)
