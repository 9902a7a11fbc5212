"""What the server measures, for `GET /metrics` (Prometheus text format, prometheus_client)
and for the per-request log (`serve --request_log`):

  transformer_jax_requests_total{code}          requests answered, by HTTP status
  transformer_jax_request_errors_total{code}    of those, the ones answered 4xx or 5xx
  transformer_jax_request_latency_seconds       from the request's body read to its answer
  transformer_jax_queue_wait_seconds            from a request's lines queued to its first
                                                model call starting
  transformer_jax_queue_depth                   lines waiting for the batcher now
  transformer_jax_batch_lines                   lines per model call
  transformer_jax_batch_length_tokens           padded length (bucket) of a model call
  transformer_jax_model_call_seconds            one model call, compilation included
  transformer_jax_compile_seconds_total         JAX tracing and compiling (a model call of a
                                                shape not seen before compiles first)
  transformer_jax_decode_length_tokens          output tokens per line (translation: up to
                                                EOS; other tasks: the line's tokens)

and for a language model's completions (streaming.py):

  transformer_jax_first_token_seconds           from a choice queued to its first token
  transformer_jax_between_tokens_seconds        from one token of a choice to its next
  transformer_jax_completion_tokens_total       tokens drawn
  transformer_jax_slots_busy                    rows of the decoding batch in use now
  transformer_jax_cache_rows, _cache_positions  the KV cache's shape now (slots.py: it holds
                                                the rows and positions in use)

Each server has its own registry, so tests can run several in one process.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import prometheus_client as prom

_LATENCY_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30)
_COMPILE_EVENTS = "/jax/core/compile/"   # jax.monitoring's trace, lowering, compile events


class CompileClock:
  """Seconds JAX spent tracing and compiling in this process, from jax.monitoring's
  compile events (one listener, registered once)."""
  _lock = threading.Lock()
  _seconds = 0.0
  _registered = False

  @classmethod
  def seconds(cls) -> float:
    with cls._lock:
      if not cls._registered:
        jax.monitoring.register_event_duration_secs_listener(cls._record)
        cls._registered = True
      return cls._seconds

  @classmethod
  def _record(cls, event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event.startswith(_COMPILE_EVENTS):
      with cls._lock:
        cls._seconds += duration_secs


class ServerMetrics:
  """The server's Prometheus metrics (see the module doc) in a registry of its own."""

  def __init__(self) -> None:
    self.registry = prom.CollectorRegistry()
    r: dict[str, Any]
    prefix, r = "transformer_jax_", {"registry": self.registry}
    self.requests = prom.Counter(prefix + "requests", "Requests answered, by HTTP status.",
                                 ["code"], **r)
    self.errors = prom.Counter(prefix + "request_errors", "Requests answered 4xx or 5xx.",
                               ["code"], **r)
    self.latency = prom.Histogram(prefix + "request_latency_seconds", "Request latency, "
                                  "body read to answer.", buckets=_LATENCY_BUCKETS, **r)
    self.queue_wait = prom.Histogram(prefix + "queue_wait_seconds", "Lines queued to their "
                                     "first model call.", buckets=_LATENCY_BUCKETS, **r)
    self.queue_depth = prom.Gauge(prefix + "queue_depth", "Lines waiting for the batcher.", **r)
    self.batch_lines = prom.Histogram(prefix + "batch_lines", "Lines per model call.",
                                      buckets=(1, 2, 4, 8, 16, 32, 64, 128), **r)
    self.batch_length = prom.Histogram(prefix + "batch_length_tokens", "Padded length of a "
                                       "model call.", buckets=(16, 32, 64, 128, 256, 512), **r)
    self.model_call = prom.Histogram(prefix + "model_call_seconds", "One model call, "
                                     "compilation included.", buckets=_LATENCY_BUCKETS, **r)
    self.compile = prom.Counter(prefix + "compile_seconds", "JAX tracing and compiling.", **r)
    self.decode_length = prom.Histogram(prefix + "decode_length_tokens", "Output tokens per "
                                        "line.", buckets=(4, 8, 16, 32, 64, 128, 256), **r)
    self.first_token = prom.Histogram(prefix + "first_token_seconds", "A choice queued to "
                                      "its first token.", buckets=_LATENCY_BUCKETS, **r)
    self.between_tokens = prom.Histogram(prefix + "between_tokens_seconds", "One token of a "
                                         "choice to its next.", buckets=_LATENCY_BUCKETS, **r)
    self.completion_tokens = prom.Counter(prefix + "completion_tokens", "Tokens drawn.", **r)
    self.slots_busy = prom.Gauge(prefix + "slots_busy", "Decoding rows in use.", **r)
    self.cache_rows = prom.Gauge(prefix + "cache_rows", "Rows the KV cache holds.", **r)
    self.cache_positions = prom.Gauge(prefix + "cache_positions", "Positions the KV cache "
                                      "holds.", **r)

  def answered(self, status: int, seconds: float | None = None) -> None:
    self.requests.labels(code=str(status)).inc()
    if status >= 400:
      self.errors.labels(code=str(status)).inc()
    if seconds is not None:
      self.latency.observe(seconds)

  def text(self) -> tuple[bytes, str]:
    """The exposition (Prometheus text format) and its Content-Type."""
    return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST
