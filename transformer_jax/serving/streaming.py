"""The server's continuous batcher for a language model's completions (POST /v1/completions,
serving/openai_api.py): one thread decodes the choices of every request in flight together,
a step at a time, and each choice's tokens go out as they are drawn.

The decoding batch has `slots` rows (slots.py keeps their KV cache on the device). A
request's choices (each prompt n times) queue, oldest first. Before each step the waiting
choices take the free slots, lowest first: their prompts run through the model in one
prefill call per prompt length bucket, which draws each one's first token. Then one step
feeds every busy row its last token at its own position and draws the next. A choice that
draws EOS, ends in a stop string or reaches max_tokens frees its slot at once, for a waiting
choice at the next step. Each row's cache is written at its own positions
(modules/attention.py), and each choice draws with a key of its seed and its own prompt
(sampling.prefill): a choice's text depends neither on the rows beside it nor on when it
joined (tests/test_streaming.py), and equals what predict writes at the same settings.

A prompt whose log-probabilities are asked for (echo with logprobs: Sampling.score_prompt)
takes no slot to be scored: up to `slots` such prompts a step go through the model whole
(sampling.score, a call per length bucket), beside the decoding rows; a choice that draws
nothing then ends, one that draws a single greedy token takes it from the scores (the one its
prefill would draw), and any other then waits for a slot as above. Drawn tokens' log-
probabilities come from the programs that draw them, where a choice asks (Sampling.logprobs).

A step runs the first rows of the batch, a power of two that holds every busy slot, over
the first positions of the cache, a length bucket that holds every busy row's position
(slots.py keeps the cache at that shape): one row early in its text costs one row over a
short window, not the whole batch over max_len. Prefill rows are padded to a power of two
by repeating the last, as lines.py pads rows.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from typing import Deque, Iterator, NamedTuple, Sequence

import numpy as np

from transformer_jax.data.tokenizer import prompt_tail
from transformer_jax.inputs import bucket_for, power_of_two
from transformer_jax.serving.metrics import CompileClock, ServerMetrics
from transformer_jax.serving.slots import DecodingBatch
from transformer_jax.serving.text_stream import Decode, TextStream


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How a request's choices draw (sampling.py): up to `max_tokens` tokens at `temperature`
  (0: greedy) from the `top_k` likeliest (0: all) within the `top_p` nucleus; `seed` fixes
  the draws; the text ends before the first of `stops`, or at one of `end_ids` (the
  request's own end tokens besides the model's: a chat template's end of turn).
  `logprobs`: each drawn token's log-probability and the likeliest at its place are
  reported (None: not); `score_prompt`: the prompt's tokens' too (then max_tokens may be
  0: the prompt is only scored)."""
  max_tokens: int
  temperature: float
  top_k: int
  top_p: float
  seed: int
  stops: tuple[str, ...] = ()
  end_ids: tuple[int, ...] = ()
  logprobs: int | None = None
  score_prompt: bool = False


class Logprob(NamedTuple):
  """A token's reported log-probability (None: a text's first token, which nothing before
  it predicts), and the likeliest tokens at its place with theirs, likeliest first."""
  token: int
  logprob: float | None
  top: tuple[tuple[int, float], ...]


_IDLE = Sampling(1, 0.0, 0, 1.0, 0)     # a row without a choice: greedy, its token unread


class Event(NamedTuple):
  """One drawn token of a choice (its index): the text it lets out (empty while held back:
  the start of a stop string, or an incomplete character), and on the choice's last token
  why it ended ("stop": EOS or a stop string; "length": max_tokens); and the log-probabilities
  reported with it (Sampling.logprobs: the token's, after its prompt's tokens' on a choice's
  first event where Sampling.score_prompt)."""
  choice: int
  text: str
  finish_reason: str | None
  logprobs: tuple[Logprob, ...] = ()


class Choice:
  """One choice of a request: a prompt's ids (cut to the context) and its progress."""

  def __init__(self, completion: "Completion", index: int, prompt: list[int], nth: int,
               decode: Decode):
    self.completion, self.index, self.prompt, self.nth = completion, index, prompt, nth
    self.text = TextStream(decode, completion.sampling.stops)
    self.drawn = 0                      # tokens drawn, EOS included
    self.finish_reason: str | None = None
    self.slot, self.position, self.last = -1, 0, 0   # where and what it feeds next
    self.key = np.zeros(2, np.uint32)
    self.last_at = 0.0                  # time.monotonic() of its last token
    self.logprobs: list[Logprob] = []   # reported: the prompt's (if scored), then the drawn
    self.unsent: list[Logprob] = []     # reported, not yet in an event
    self.scored = not completion.sampling.score_prompt


class Completion:
  """One request: each prompt's n choices (prompt i's choice j has index i * n + j, as
  OpenAI numbers them) and the events of their tokens as they are drawn."""

  def __init__(self, prompts: Sequence[list[int]], n: int, sampling: Sampling, decode: Decode):
    self.sampling = sampling
    self.choices = [Choice(self, i * n + j, prompt, j, decode)
                    for i, prompt in enumerate(prompts) for j in range(n)]
    self.prompt_tokens = sum(len(p) for p in prompts)
    self.queued = time.monotonic()
    self.error: str | None = None       # set when the model failed
    self.cancelled = False              # set when the client went away
    self._events: queue.SimpleQueue[Event | None] = queue.SimpleQueue()

  @property
  def completion_tokens(self) -> int:
    return sum(c.drawn for c in self.choices)

  def put(self, event: Event | None) -> None:
    self._events.put(event)

  def events(self) -> Iterator[list[Event]]:
    """The events as they come, each time all that are there (a reader that fell behind
    catches up at once), until every choice has ended or the model failed (then `error`
    says how)."""
    ended = 0
    while ended < len(self.choices):
      got = [self._events.get()]
      while not self._events.empty():
        got.append(self._events.get_nowait())
      events = [event for event in got if event is not None]
      ended += sum(event.finish_reason is not None for event in events)
      if events:
        yield events
      if len(events) < len(got):      # None: the model failed
        return

  def wait(self) -> None:
    for _ in self.events():
      pass


class StreamBatcher:
  """Decodes the choices of concurrent completions in one batch of `batch.slots` rows (see
  the module doc). `start=False` runs no thread: the caller calls `run_once` (tests)."""

  def __init__(self, batch: DecodingBatch, decode: Decode, end_ids: Sequence[int],
               metrics: ServerMetrics | None = None, start: bool = True):
    self.batch, self.decode, self.end_ids = batch, decode, tuple(end_ids)
    self.max_len = batch.programs.max_len
    self.buckets = batch.lengths        # prompt widths and windows: the cache's lengths
    self.metrics = metrics or ServerMetrics()
    self._rows: list[Choice | None] = [None] * batch.slots
    self._waiting: Deque[Choice] = collections.deque()
    self._cond = threading.Condition()
    if start:
      threading.Thread(target=self._loop, name="streams", daemon=True).start()

  def submit(self, prompts: Sequence[Sequence[int]], n: int, sampling: Sampling) -> Completion:
    """Queues `n` choices of each prompt (ids as `prompt_ids` encodes them), each cut to
    the context max_tokens leaves, as predict cuts it."""
    context = self.max_len - sampling.max_tokens
    kept = [prompt_tail(np.asarray(p, np.int32), context).tolist() for p in prompts]
    completion = Completion(kept, n, sampling, self.decode)
    with self._cond:
      self._waiting.extend(completion.choices)
      self._cond.notify()
    return completion

  def warm_up(self, tokens: int) -> int:
    """Compiles the programs for every batch shape that texts of up to `tokens` tokens
    (prompt and completion) use, so that no request waits for a model's compilation (each
    new shape otherwise compiles on first use); returns how many shapes. Before any
    request."""
    last = bucket_for(min(tokens, self.max_len), self.buckets)
    return self.batch.warm_up([width for width in self.buckets if width <= last])

  def idle(self) -> bool:
    with self._cond:
      return not self._waiting and all(row is None for row in self._rows)

  def run_once(self) -> None:
    """Admits waiting choices to free slots, then steps the busy rows once."""
    compiled = CompileClock.seconds()
    try:
      self._admit()
      self._step()
    except Exception as e:  # noqa: BLE001  (a model failure is answered, not fatal)
      self._fail(f"{type(e).__name__}: {e}")
    self.metrics.compile.inc(CompileClock.seconds() - compiled)   # a new shape compiled

  def _loop(self) -> None:
    while True:
      with self._cond:
        self._cond.wait_for(lambda: self._waiting or any(r is not None for r in self._rows))
      self.run_once()

  # ------------------------------------------------------------------------ admission
  def _admit(self) -> None:
    """Waiting choices, oldest first, take the free slots; a prompt to score takes none (it
    is scored first, up to `slots` prompts a step beside the decoding rows); the rows of a
    completion whose client went away free theirs first."""
    with self._cond:
      self._rows = [None if row is not None and row.completion.cancelled else row
                    for row in self._rows]
      free = [slot for slot, row in enumerate(self._rows) if row is None]
      joining: list[Choice] = []
      scoring: list[Choice] = []
      kept: Deque[Choice] = collections.deque()
      for choice in self._waiting:
        if choice.completion.cancelled or choice.completion.error:
          continue
        if not choice.scored and len(scoring) < self.batch.slots:
          scoring.append(choice)
        elif choice.scored and len(joining) < len(free):
          joining.append(choice)
        else:
          kept.append(choice)
      self._waiting = kept
      for choice, slot in zip(joining, free):
        choice.slot, self._rows[slot] = slot, choice
    if scoring:
      self._score(scoring)
    groups: dict[int, list[Choice]] = {}
    for choice in joining:
      groups.setdefault(bucket_for(len(choice.prompt), self.buckets), []).append(choice)
    for width, group in sorted(groups.items()):
      self._prefill(group, width)

  def _score(self, choices: list[Choice]) -> None:
    """The prompts' log-probabilities (sampling.score), in calls of up to score_rows rows of
    a length bucket. A choice that draws nothing ends; one that draws one token greedily
    takes it from the scores (the token its prefill would draw); others wait for a slot."""
    groups: dict[int, list[Choice]] = {}
    for choice in choices:
      groups.setdefault(bucket_for(max(len(choice.prompt), 1), self.buckets),
                        []).append(choice)
    waiting: list[Choice] = []
    for width, group in sorted(groups.items()):
      size = self.batch.score_rows(width)
      for first in range(0, len(group), size):
        chunk = group[first:first + size]
        texts = np.zeros((power_of_two(len(chunk)), width), np.int32)
        for row, choice in enumerate(chunk):
          texts[row, :len(choice.prompt)] = choice.prompt
        texts[len(chunk):] = texts[len(chunk) - 1]     # filler rows repeat the last
        wanted = np.array([c.completion.sampling.logprobs or 0 for c in chunk])
        chosen, ids, values = self.batch.score(texts, np.resize(wanted, len(texts)))
        now = time.monotonic()
        for row, choice in enumerate(chunk):
          if self._scored(choice, chosen[row], ids[row], values[row], now):
            waiting.append(choice)
    with self._cond:
      self._waiting.extendleft(reversed(waiting))

  def _scored(self, choice: Choice, chosen: np.ndarray, ids: np.ndarray, values: np.ndarray,
              now: float) -> bool:
    """Reports a scored prompt's log-probabilities with the choice's first event; whether
    the choice goes on to draw its tokens in a slot."""
    prompt, sampling = choice.prompt, choice.completion.sampling
    choice.scored = True
    choice.unsent = [Logprob(token, None, ()) if t == 0 else
                     Logprob(token, float(chosen[t]), _top(ids[t - 1], values[t - 1]))
                     for t, token in enumerate(prompt)]
    choice.logprobs.extend(choice.unsent)
    if sampling.max_tokens == 0:
      choice.finish_reason = "length"
      choice.completion.put(Event(choice.index, "", "length", tuple(choice.unsent)))
      return False
    if sampling.max_tokens == 1 and sampling.temperature == 0 and prompt:
      last = len(prompt) - 1
      token = int(ids[last, 0])
      self.metrics.first_token.observe(now - choice.completion.queued)
      self._emit(choice, token, now, Logprob(token, float(values[last, 0]),
                                             _top(ids[last], values[last])))
      return False
    return True

  def _prefill(self, group: list[Choice], width: int) -> None:
    rows = [*group, *[group[-1]] * (power_of_two(len(group)) - len(group))]
    prompts = np.zeros((len(rows), width), np.int32)
    for row, choice in enumerate(rows):
      prompts[row, :len(choice.prompt)] = choice.prompt
    sampling = [c.completion.sampling for c in rows]
    first, lengths, keys, reported = self.batch.prefill(
        np.array([c.slot for c in rows]), prompts, np.array([s.max_tokens for s in sampling]),
        np.array([s.seed for s in sampling], np.uint32), np.array([c.nth for c in rows]),
        *self._settings(sampling))
    now = time.monotonic()
    for row, choice in enumerate(group):
      choice.position, choice.key = int(lengths[row]), keys[row]
      self.metrics.first_token.observe(now - choice.completion.queued)
      self._emit(choice, int(first[row]), now, _logprob(choice, int(first[row]), reported, row))

  @staticmethod
  def _settings(sampling: Sequence[Sampling]) -> tuple[np.ndarray, ...]:
    return (np.array([s.temperature for s in sampling], np.float32),
            np.array([s.top_k for s in sampling], np.int32),
            np.array([s.top_p for s in sampling], np.float32),
            np.array([s.logprobs is not None for s in sampling], np.int32))

  # ----------------------------------------------------------------------------- step
  def _step(self) -> None:
    busy = [(slot, row) for slot, row in enumerate(self._rows) if row is not None]
    self.metrics.slots_busy.set(len(busy))
    if not busy:
      return
    count = min(self.batch.slots, power_of_two(busy[-1][0] + 1))   # rows 0..count-1
    tokens, positions = np.zeros(count, np.int32), np.zeros(count, np.int32)
    keys = np.zeros((count, 2), np.uint32)
    sampling = [_IDLE] * count
    for slot, row in busy:
      tokens[slot], positions[slot], keys[slot] = row.last, row.position, row.key
      sampling[slot] = row.completion.sampling
    window = bucket_for(int(positions.max()) + 1, self.buckets)
    drawn, reported = self.batch.step(window, tokens, positions, keys,
                                      *self._settings(sampling))
    rows, length = self.batch.shape
    self.metrics.cache_rows.set(rows)
    self.metrics.cache_positions.set(length)
    now = time.monotonic()
    for slot, row in busy:
      row.position += 1
      self.metrics.between_tokens.observe(now - row.last_at)
      self._emit(row, int(drawn[slot]), now, _logprob(row, int(drawn[slot]), reported, slot))

  def _emit(self, choice: Choice, token: int, now: float, logprob: Logprob | None) -> None:
    """Records `token` as `choice`'s next and sends its event, with the log-probabilities
    reported since the last; frees the slot of a choice that ended."""
    choice.drawn += 1
    choice.last, choice.last_at = token, now
    self.metrics.completion_tokens.inc()
    reason: str | None
    if token in self.end_ids or token in choice.completion.sampling.end_ids:
      text, reason = choice.text.finish(), "stop"
    else:
      text, stopped = choice.text.add(token)
      reason = "stop" if stopped else None
      if reason is None and choice.drawn == choice.completion.sampling.max_tokens:
        text, reason = text + choice.text.finish(), "length"
    if reason is not None:
      choice.finish_reason = reason
      self._free(choice)
    if logprob is not None:
      choice.logprobs.append(logprob)
      choice.unsent.append(logprob)
    choice.completion.put(Event(choice.index, text, reason, tuple(choice.unsent)))
    choice.unsent = []

  def _free(self, choice: Choice) -> None:
    with self._cond:
      if choice.slot >= 0 and self._rows[choice.slot] is choice:
        self._rows[choice.slot] = None

  def _fail(self, error: str) -> None:
    """Ends every busy row's request with `error`; the cache starts anew."""
    with self._cond:
      failed = {id(r.completion): r.completion for r in self._rows if r is not None}
      self._rows = [None] * self.batch.slots
    for completion in failed.values():
      completion.error = error
      completion.put(None)
    self.batch.reset()

def _top(ids: np.ndarray, values: np.ndarray) -> tuple[tuple[int, float], ...]:
  """The likeliest tokens and their log-probabilities, those the model may draw (a
  vocabulary smaller than the top's count leaves the -inf ones out)."""
  return tuple((int(i), float(v)) for i, v in zip(ids, values) if np.isfinite(v))


def _logprob(choice: Choice, token: int, reported: tuple[np.ndarray, ...],
             row: int) -> Logprob | None:
  """The reported log-probability of `token`, row `row` of a program's output, where
  `choice` asks for them."""
  if choice.completion.sampling.logprobs is None:
    return None
  chosen, ids, values = reported
  return Logprob(token, float(chosen[row]), _top(ids[row], values[row]))
