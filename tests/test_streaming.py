"""A served language model's continuous batcher (serving/streaming.py, serving/slots.py) on
a tiny exported model, in this process: its choices draw what predict draws at the same
settings; a choice's tokens depend neither on the rows beside it nor on when it joined;
its text is let out as its tokens come, held back only where it may still change or begin
a stop string; a failed model call ends its requests and the batcher serves on. Over HTTP,
with the openai client: tests/test_serve_completions.py."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from test_lm import MODERN, lm_config

from transformer_jax.data.tokenizer import CharVocab
from transformer_jax.options import DecodeOptions
from transformer_jax.serving.streaming import Sampling, StreamBatcher
from transformer_jax.serving.text_stream import TextStream

CHARS = " abcdefghijklmnopqrstuvwxyz"
PROMPTS = ["the king", "a", "", "queen of hearts and the crown"]


def write_lm_artifact(directory: str) -> SimpleNamespace:
  """A random character language model (rotary positions, grouped keys, max_len 24)
  exported as a serving artifact: its directory, task and parameters."""
  from transformer_jax.serving import write_artifact
  from transformer_jax.tasks.lm import LanguageModelTask
  cfg = lm_config(**MODERN, vocab_size=4 + len(CHARS))
  task = LanguageModelTask(cfg, tokenizer=CharVocab(list(CHARS)))
  params = task.model.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32))["params"]
  write_artifact(task, params, DecodeOptions(max_new_tokens=8, temperature=0.8), directory,
                 lines=task.line_policy(None))
  return SimpleNamespace(directory=directory, task=task, params=params)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> SimpleNamespace:
  from transformer_jax.serving import Served
  written = write_lm_artifact(str(tmp_path_factory.mktemp("lm") / "artifact"))
  written.served = Served.load(written.directory)
  return written


@functools.lru_cache(maxsize=None)
def _batcher(served, slots: int) -> StreamBatcher:
  """One batcher (and its compiled programs) per slot count, reused while idle."""
  from transformer_jax.serving.slots import DecodingBatch
  return StreamBatcher(DecodingBatch(served.streaming, slots), served.tokenizer.decode,
                       served.end_ids, start=False)


def _run(streams: StreamBatcher, steps: int | None = None) -> None:
  """`steps` steps, or until every choice has ended."""
  done = 0
  while not streams.idle() and (steps is None or done < steps):
    streams.run_once()
    done += 1


def _ids(model, prompts: list[str]) -> list[list[int]]:
  return [line.ids for line in model.served.encode(prompts)]


@pytest.mark.parametrize("sampling", [
    Sampling(8, 0.0, 0, 1.0, 0),         # greedy
    Sampling(12, 1.0, 5, 0.9, 7),        # top-k and top-p
    Sampling(20, 0.8, 0, 1.0, 3)],       # the long prompt keeps its last 4 ids after BOS
    ids=["greedy", "top_k_top_p", "long_prompt_cut"])
def test_completions_draw_what_predict_draws(model, sampling):
  streams = _batcher(model.served, 4)
  completion = streams.submit(_ids(model, PROMPTS), 1, sampling)
  _run(streams)
  decode = DecodeOptions(max_new_tokens=sampling.max_tokens, temperature=sampling.temperature,
                         top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed)
  expected = model.task.continue_prompts(model.params, _ids(model, PROMPTS), decode)
  texts = [choice.text.sent for choice in completion.choices]
  assert completion.error is None and texts == expected
  assert len(set(texts)) > 1, texts
  for choice in completion.choices:     # EOS ends a choice early ("stop"), counted as drawn
    assert choice.finish_reason == ("length" if choice.drawn == sampling.max_tokens
                                    else "stop")
    assert choice.drawn == len(choice.text.ids) + (choice.finish_reason == "stop")


def test_a_choice_depends_neither_on_its_neighbours_nor_on_when_it_joined(model):
  """A choice alone in the batch, and the same choice queued at the fourth step while
  others join and leave: the same tokens (top-k and top-p draws, other rows at other
  positions and settings, more choices than slots, a slot another choice used before)."""
  probe, settings = _ids(model, ["the queen"]), Sampling(12, 1.0, 6, 0.95, 21)
  alone = _batcher(model.served, 4).submit(probe, 1, settings)
  _run(_batcher(model.served, 4))
  streams = _batcher(model.served, 4)
  long = streams.submit(_ids(model, ["a crown"]), 1, Sampling(16, 0.7, 0, 1.0, 1))
  short = streams.submit(_ids(model, ["king", "of"]), 1, Sampling(2, 1.0, 0, 0.8, 2))
  _run(streams, 3)
  joined = streams.submit(probe, 1, settings)
  many = streams.submit(_ids(model, PROMPTS), 2, Sampling(6, 1.0, 3, 1.0, 5))
  _run(streams)
  choice = joined.choices[0]
  assert all(c.finish_reason for c in long.choices + short.choices + many.choices)
  assert choice.slot != alone.choices[0].slot             # another slot, after another row
  assert choice.text.ids == alone.choices[0].text.ids and len(choice.text.ids) > 3
  assert (choice.finish_reason, choice.text.sent) == (alone.choices[0].finish_reason,
                                                      alone.choices[0].text.sent)
  # Choices of one prompt differ (each its own key), and n does not change the first.
  assert len({c.text.sent for c in many.choices}) > len(PROMPTS)


def test_a_cancelled_completion_frees_its_slots_at_the_next_step(model):
  """A client that went away (the server sets `cancelled` when a write fails): its choices
  leave their slots at the next step, and the waiting ones take them."""
  streams = _batcher(model.served, 4)
  leaving = streams.submit(_ids(model, ["the king"]), 4, Sampling(20, 1.0, 0, 1.0, 0))
  waiting = streams.submit(_ids(model, ["a"]), 1, Sampling(3, 0.0, 0, 1.0, 0))
  streams.run_once()
  assert all(c.slot >= 0 and not c.finish_reason for c in leaving.choices)
  drawn = [c.drawn for c in leaving.choices]
  leaving.cancelled = True
  streams.run_once()
  assert waiting.choices[0].slot >= 0 and waiting.choices[0].drawn == 2   # joined, stepped
  assert [c.drawn for c in leaving.choices] == drawn         # none stepped again
  _run(streams)
  assert waiting.choices[0].finish_reason and streams.idle()


def test_a_choice_is_the_same_while_the_cache_grows_and_shrinks_around_it(model):
  """The cache holds the rows and positions the busy slots need (serving/slots.py): a choice
  beside rows that join late, high in the batch, and leave early draws what it draws alone,
  while the cache grows in rows and positions and shrinks back."""
  from transformer_jax.serving.slots import DecodingBatch
  probe, settings = _ids(model, ["the queen"]), Sampling(14, 1.0, 6, 0.95, 21)
  alone = _batcher(model.served, 8).submit(probe, 1, settings)
  _run(_batcher(model.served, 8))
  streams = StreamBatcher(DecodingBatch(model.served.streaming, 8, shrink_after=2),
                          model.served.tokenizer.decode,
                          model.served.end_ids, start=False)
  watched = streams.submit(probe, 1, settings)
  shapes = []
  for step in range(20):
    if step == 2:     # five more rows: the cache grows from 1 to 8 rows, then back
      streams.submit(_ids(model, PROMPTS + ["x"]), 1, Sampling(3, 1.0, 0, 1.0, 4))
    streams.run_once()
    shapes.append(streams.batch.shape)
    gauges = [streams.metrics.registry.get_sample_value(f"transformer_jax_cache_{name}")
              for name in ("rows", "positions")]
    assert tuple(gauges) == streams.batch.shape            # what /metrics shows
  rows = [r for r, _ in shapes]
  assert rows[0] == 1 and max(rows) == 8 and rows[-1] == 1 and streams.idle()
  assert len({length for _, length in shapes}) > 1        # positions grew past a bucket
  assert watched.choices[0].text.ids == alone.choices[0].text.ids
  assert watched.choices[0].text.sent == alone.choices[0].text.sent


def test_after_warm_up_no_request_waits_for_a_compilation(model):
  """warm_up compiles every program a text within its tokens needs: prefills, steps, and the
  cache's writes and resizes as rows join, leave and grow (serving/slots.py)."""
  from transformer_jax.serving.metrics import CompileClock
  from transformer_jax.serving.slots import DecodingBatch
  streams = StreamBatcher(DecodingBatch(model.served.streaming, 8, shrink_after=2),
                          model.served.tokenizer.decode,
                          model.served.end_ids, start=False)
  assert streams.warm_up(24) == (4 + 4 + 1) * 2   # 1, 2, 4, 8 rows, scores; 16, 24 positions
  compiled, shapes = CompileClock.seconds(), set()
  for step in range(30):
    if step in (0, 3, 4, 12):
      streams.submit(_ids(model, PROMPTS[:1 + step % 4]), 2, Sampling(5 + step, 1.0, 0, 1.0, step))
    streams.run_once()
    shapes.add(streams.batch.shape)
  assert len(shapes) > 3 and CompileClock.seconds() == compiled


def test_text_is_let_out_once_it_can_no_longer_change():
  """Bytes as tokens (a byte-level tokenizer): an incomplete character, and the start of a
  stop string, are held back; the text ends before the stop string."""
  decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")   # noqa: E731
  stream = TextStream(decode, ["STOP", "xy"])
  deltas = [stream.add(token) for token in "Tu é S".encode()]
  assert deltas == [("T", False), ("u", False), (" ", False), ("", False), ("é", False),
                    (" ", False), ("", False)]                 # é is two bytes; S may be STOP
  assert stream.add(ord("T")) == ("", False) and stream.add(ord("O")) == ("", False)
  assert stream.add(ord("P")) == ("", True) and stream.sent == "Tu é "
  held = TextStream(decode, ["xy"])
  assert [held.add(t)[0] for t in b"ax"] == ["a", ""] and held.finish() == "x"
  assert held.sent == "ax"


def test_a_failed_step_ends_its_requests_and_the_batcher_serves_on(model, monkeypatch):
  streams = _batcher(model.served, 4)
  settings = Sampling(6, 0.0, 0, 1.0, 0)
  before = streams.submit(_ids(model, ["the"]), 1, settings)
  _run(streams)
  failing = streams.submit(_ids(model, ["the"]), 1, settings)
  _run(streams, 1)                              # its first two tokens: prefill, a step
  with monkeypatch.context() as patch:
    patch.setattr(streams.batch, "step", lambda *a: (_ for _ in ()).throw(RuntimeError("no")))
    _run(streams, 1)
  assert failing.error == "RuntimeError: no" and streams.idle()
  assert [e.finish_reason for events in failing.events() for e in events] == [None, None]
  after = streams.submit(_ids(model, ["the"]), 1, settings)
  _run(streams)
  assert after.error is None and after.choices[0].text.sent == before.choices[0].text.sent
