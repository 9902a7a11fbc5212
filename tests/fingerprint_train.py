"""`python tests/fingerprint_train.py [train.py flags]`: train.py that also writes, for each
training batch this process feeds, one line to $FINGERPRINTS.<process index>: a JSON list
of the sha256 of each of its rows (all arrays of the row). A global batch's fingerprint is
then the processes' lists joined in process order, whatever the number of processes."""

import hashlib
import json
import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]

import jax  # noqa: E402
from absl import app  # noqa: E402
from data_wrappers import BatchesWrapper, SourceWrapper  # noqa: E402

import train  # noqa: E402  (defines train.py's flags)
from transformer_jax.training import experiment  # noqa: E402


class FingerprintedBatches(BatchesWrapper):

  def __next__(self):
    batch = next(self.batches)
    rows = len(next(iter(batch.values())))
    hashes = [hashlib.sha256(b"".join(batch[k][i].tobytes() for k in sorted(batch))).hexdigest()
              for i in range(rows)]
    with open(f"{os.environ['FINGERPRINTS']}.{jax.process_index()}", "a") as f:
      f.write(json.dumps(hashes) + "\n")
    return batch


_make_source = experiment.make_source
experiment.make_source = lambda *args: SourceWrapper(_make_source(*args), FingerprintedBatches)

if __name__ == "__main__":
  app.run(train.main)
