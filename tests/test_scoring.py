"""Log-probabilities of a served language model (sampling.score and the streaming programs'
reports; serving/streaming.py, serving/logprobs.py) on the tiny exported model of
tests/test_streaming.py: a prompt's scores are the model's log-softmax; the log-probabilities
reported while drawing, through the KV cache, are those of scoring the whole text at once;
a greedy token drawn from the scores is the one the prefill draws; and scoring requests
sharing the batch with generating ones change nobody's tokens. lm-evaluation-harness against
the server: tests/test_lm_eval.py."""

from __future__ import annotations

import numpy as np
import pytest
import test_streaming
from test_streaming import PROMPTS, _batcher, _ids, _run

from transformer_jax.sampling import banned_ids
from transformer_jax.serving.logprobs import LogprobsFormat
from transformer_jax.serving.streaming import Sampling

model = test_streaming.model     # the fixture: the tiny exported model
SCORE_ONLY = Sampling(0, 0.0, 0, 1.0, 0, logprobs=5, score_prompt=True)


def _log_softmax(lm, ids: list[int]) -> np.ndarray:
  """The Flax model's log-probabilities after each token of `ids` (the banned ids -inf)."""
  logits = np.asarray(lm.task.model.apply({"params": lm.params}, np.array([ids])),
                      np.float64)[0]
  logits[:, list(banned_ids(lm.task.model_config))] = -np.inf
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_a_scored_prompt_has_the_models_log_softmax(model):
  streams = _batcher(model.served, 4)
  prompts = _ids(model, PROMPTS[:2] + PROMPTS[3:])
  completion = streams.submit(prompts, 1, SCORE_ONLY)
  _run(streams)
  assert completion.error is None
  for ids, choice in zip(prompts, completion.choices):
    expected = _log_softmax(model, ids)
    assert choice.finish_reason == "length" and choice.drawn == 0
    assert [r.token for r in choice.logprobs] == ids and choice.logprobs[0].logprob is None
    for t, reported in enumerate(choice.logprobs[1:], 1):
      assert reported.logprob == pytest.approx(expected[t - 1, ids[t]], abs=1e-5)
      top = [token for token, _ in reported.top]
      assert top == list(np.argsort(-expected[t - 1], kind="stable")[:5])
      assert [v for _, v in reported.top] == pytest.approx(
          list(np.sort(expected[t - 1])[::-1][:5]), abs=1e-5)


def test_logprobs_reported_while_drawing_are_the_scores_of_the_whole_text(model):
  """Through the KV cache, a step at a time, sampled at temperature 1 with top-k: each
  drawn token's reported log-probability (before temperature and the cut) is the one
  scoring the prompt and its continuation at once gives it."""
  streams = _batcher(model.served, 4)
  prompts = _ids(model, PROMPTS[:2])
  drawn = streams.submit(prompts, 2, Sampling(10, 1.0, 5, 1.0, 3, logprobs=2))
  _run(streams)
  texts = [prompts[c.index // 2] + [r.token for r in c.logprobs] for c in drawn.choices]
  scored = streams.submit(texts, 1, SCORE_ONLY)
  _run(streams)
  for choice, whole in zip(drawn.choices, scored.choices):
    start = len(prompts[choice.index // 2])
    assert len(choice.logprobs) == choice.drawn > 1
    for mine, theirs in zip(choice.logprobs, whole.logprobs[start:]):
      assert mine.token == theirs.token
      assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
      assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]


def test_scoring_shares_the_batch_and_changes_no_ones_tokens(model):
  """Generating choices drawn alone, then again while prompts are scored (echo, no new
  tokens; and one greedy token taken from the scores) in the same steps: the same tokens
  and the same scores."""
  streams = _batcher(model.served, 4)
  generating = _ids(model, PROMPTS)
  settings = Sampling(9, 1.0, 0, 0.9, 11)
  alone = streams.submit(generating, 2, settings)
  _run(streams)
  scoring = _ids(model, ["the crown", "of hearts"])
  scored_alone = streams.submit(scoring, 1, SCORE_ONLY)
  _run(streams)
  together = streams.submit(generating, 2, settings)
  streams.run_once()                                    # the generating rows are busy
  scored = streams.submit(scoring, 1, SCORE_ONLY)
  greedy = streams.submit(scoring, 1, Sampling(1, 0.0, 0, 1.0, 0, logprobs=1,
                                               score_prompt=True))
  streams.run_once()
  assert all(c.finish_reason for c in scored.choices + greedy.choices)   # in one step
  assert not all(c.finish_reason for c in together.choices)
  _run(streams)
  assert [c.text.ids for c in together.choices] == [c.text.ids for c in alone.choices]
  for mine, theirs in zip(scored.choices, scored_alone.choices):   # other rows beside them
    assert [r.token for r in mine.logprobs] == [r.token for r in theirs.logprobs]
    assert [r.logprob for r in mine.logprobs[1:]] == pytest.approx(
        [r.logprob for r in theirs.logprobs[1:]], abs=1e-5)
  prefilled = streams.submit(scoring, 1, Sampling(1, 0.0, 0, 1.0, 0, logprobs=1))
  _run(streams)
  for mine, theirs in zip(greedy.choices, prefilled.choices):   # scores' token = prefill's
    assert mine.text.ids == theirs.text.ids and len(mine.logprobs) == len(mine.prompt) + 1
    assert mine.logprobs[-1].logprob == pytest.approx(theirs.logprobs[0].logprob, abs=1e-5)


def test_the_legacy_logprobs_shape(model):
  """tokens, token_logprobs (the first null), top_logprobs (the top k and the token itself),
  text_offset (the token strings end to end)."""
  streams = _batcher(model.served, 4)
  completion = streams.submit(_ids(model, ["the king"]), 1, SCORE_ONLY)
  _run(streams)
  reported = completion.choices[0].logprobs
  block, end = LogprobsFormat(model.served.tokenizer).block(reported, 1, offset=3)
  assert block["tokens"][1:] == list("the king") and block["token_logprobs"][0] is None
  assert block["text_offset"] == [3, *range(3, 3 + 8)] and end == 3 + 8
  assert block["top_logprobs"][0] is None
  for top, r in zip(block["top_logprobs"][1:], reported[1:]):
    best = model.served.tokenizer.decode([r.top[0][0]])
    assert top[best] == r.top[0][1] and top[block["tokens"][reported.index(r)]] == r.logprob
    assert len(top) == (1 if r.top[0][0] == r.token else 2)
