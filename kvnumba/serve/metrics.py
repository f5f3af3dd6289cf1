"""`/metrics` in Prometheus' text format (`Metrics`): requests running and waiting,
tokens generated and prompt tokens admitted, the prefix cache's hit rate, the model
cache's pages held, cached and free, draft acceptance and the step time, in a registry
of the server's own."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

#: the step time histogram's buckets, in seconds (a GPU step to a CUDA simulator's)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """The server's Prometheus metrics: gauges read from the engine loop's latest
    `Snapshot` at each scrape, counters and the step histogram fed by `stepped`."""

    def __init__(self, server):
        self.server = server
        self.registry = registry = CollectorRegistry()

        def gauge(name: str, doc: str, read, **labels) -> None:
            metric = Gauge(name, doc, list(labels), registry=registry)
            if labels:
                for value in next(iter(labels.values())):
                    metric.labels(value).set_function(
                        lambda value=value: read(self.snapshot, value))
            else:
                metric.set_function(lambda: read(self.snapshot))

        gauge("kvnumba_requests_running", "Requests admitted and generating.",
              lambda s: s.running)
        gauge("kvnumba_requests_waiting", "Requests queued for admission.",
              lambda s: s.waiting)
        gauge("kvnumba_cache_pages", "The model cache's pages: held by sequences, cached "
              "(held by the prefix index alone, reclaimable) or free.",
              lambda s, state: getattr(s, state), state=("held", "cached", "free"))
        gauge("kvnumba_prefix_cache_hit_rate", "Prompt tokens served from the prefix "
              "index over prompt tokens admitted (0 before any).",
              lambda s: s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0)
        gauge("kvnumba_prompt_tokens", "Prompt tokens of the requests admitted so far.",
              lambda s: s.prompt_tokens)
        gauge("kvnumba_prompt_tokens_cached", "Prompt tokens served from the prefix index "
              "so far.", lambda s: s.cached_tokens)
        gauge("kvnumba_draft_acceptance_rate", "Draft tokens accepted over proposed (0 "
              "before any was proposed, or without a draft model).",
              lambda s: s.accepted / s.proposed if s.proposed else 0.0)
        gauge("kvnumba_draft_tokens_proposed", "Draft tokens proposed so far.",
              lambda s: s.proposed)
        self.generated = Counter("kvnumba_generation_tokens", "Tokens generated.",
                                 registry=registry)
        self.steps = Histogram("kvnumba_step_seconds", "Time of one engine step.",
                               buckets=STEP_BUCKETS, registry=registry)

    @property
    def snapshot(self):
        return self.server.loop.snapshot

    def stepped(self, seconds: float, tokens: int) -> None:
        """Count one engine step (called from the engine thread)."""
        self.steps.observe(seconds)
        self.generated.inc(tokens)

    async def endpoint(self, request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
