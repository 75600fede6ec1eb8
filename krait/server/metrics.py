"""Prometheus metrics of the server, named like vLLM's with a `krait:` prefix.

`ServerMetrics` implements the async engine's observer interface (`on_engine_stats`,
`on_first_token`, `on_tokens`, `on_finished`); the engine thread calls it, which prometheus-client
allows (its metrics are thread-safe).
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # no `*_created` series, as in vLLM

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    """The server's metrics on their own registry (so several apps can live in one process)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        kw = {"labelnames": labels, "registry": self.registry}

        def one(metric):
            return metric.labels(model_name=model_name)

        self.num_running = one(Gauge(
            "krait:num_requests_running", "Requests in the model's running batch.", **kw))
        self.num_waiting = one(Gauge(
            "krait:num_requests_waiting", "Requests waiting to be scheduled.", **kw))
        self.kv_cache_usage = one(Gauge(
            "krait:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", **kw))
        self.prompt_tokens = one(Counter(
            "krait:prompt_tokens", "Prefill tokens processed.", **kw))
        self.generation_tokens = one(Counter(
            "krait:generation_tokens", "Generation tokens produced.", **kw))
        self.prefix_queries = one(Counter(
            "krait:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", **kw))
        self.prefix_hits = one(Counter(
            "krait:prefix_cache_hits", "Prompt tokens found in the prefix cache.", **kw))
        self._prefix_seen = (0, 0)
        self.spec_drafts = one(Counter(
            "krait:spec_decode_num_drafts", "Speculative verify steps that carried drafts.", **kw))
        self.spec_draft_tokens = one(Counter(
            "krait:spec_decode_num_draft_tokens", "Draft tokens verified.", **kw))
        self.spec_accepted_tokens = one(Counter(
            "krait:spec_decode_num_accepted_tokens", "Draft tokens accepted.", **kw))
        per_pos = Counter(
            "krait:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position.",
            labelnames=["model_name", "position"], registry=self.registry)
        self._spec_per_pos = lambda j: per_pos.labels(model_name=model_name, position=str(j))
        self._spec_seen: dict[str, int | list[int]] = {}
        self.ttft = one(Histogram(
            "krait:time_to_first_token_seconds", "Time to first token in seconds.",
            buckets=TTFT_BUCKETS, **kw))
        self.itl = one(Histogram(
            "krait:inter_token_latency_seconds", "Time between output steps of a request.",
            buckets=ITL_BUCKETS, **kw))
        self.e2e = one(Histogram(
            "krait:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
            buckets=E2E_BUCKETS, **kw))
        success = Counter(
            "krait:request_success", "Finished requests, by finish reason.",
            labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.finished = {r: success.labels(model_name=model_name, finished_reason=r)
                         for r in FINISH_REASONS}

    # --- the async engine's observer interface

    def on_engine_stats(self, stats: dict) -> None:
        self.num_running.set(stats.get("num_running", 0))
        self.num_waiting.set(stats.get("num_waiting", 0))
        self.kv_cache_usage.set(stats.get("kv_cache_usage", 0.0))
        # the engine counts since start; the counters take the increase
        queries, hits = stats.get("prefix_cache_queries", 0), stats.get("prefix_cache_hits", 0)
        self.prefix_queries.inc(max(queries - self._prefix_seen[0], 0))
        self.prefix_hits.inc(max(hits - self._prefix_seen[1], 0))
        self._prefix_seen = (queries, hits)
        for key, counter in (("spec_decode_num_drafts", self.spec_drafts),
                             ("spec_decode_num_draft_tokens", self.spec_draft_tokens),
                             ("spec_decode_num_accepted_tokens", self.spec_accepted_tokens)):
            if key in stats:
                counter.inc(max(stats[key] - self._spec_seen.get(key, 0), 0))
                self._spec_seen[key] = stats[key]
        per_pos = stats.get("spec_decode_num_accepted_tokens_per_pos")
        if per_pos is not None:
            seen = self._spec_seen.get("per_pos") or [0] * len(per_pos)
            for j, (now, before) in enumerate(zip(per_pos, seen)):
                self._spec_per_pos(j).inc(max(now - before, 0))
            self._spec_seen["per_pos"] = list(per_pos)

    def on_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, num_new_tokens: int, inter_token_latency: float | None) -> None:
        self.generation_tokens.inc(num_new_tokens)
        if inter_token_latency is not None:
            self.itl.observe(inter_token_latency)

    def on_finished(self, e2e_latency: float, finish_reason: str | None) -> None:
        self.e2e.observe(e2e_latency)
        reason = finish_reason if finish_reason in self.finished else "error"
        self.finished[reason].inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
