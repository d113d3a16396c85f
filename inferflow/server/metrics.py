"""Prometheus metrics (``GET /metrics``), one registry per server so tests can run several."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from inferflow.engine.engine import Engine

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge(
            "inferflow_requests_running", "sequences in the running batch", registry=r
        )
        self.waiting = Gauge("inferflow_requests_waiting", "requests waiting to start", registry=r)
        self.kv_usage = Gauge(
            "inferflow_kv_cache_usage_ratio", "fraction of KV-cache blocks in use", registry=r
        )
        self.kv_free = Gauge("inferflow_kv_cache_free_blocks", "free KV-cache blocks", registry=r)
        self.preemptions = Gauge(
            "inferflow_preemptions", "requests preempted so far (KV cache full)", registry=r
        )
        self.prompt_tokens = Counter(
            "inferflow_prompt_tokens", "prompt tokens of accepted requests", registry=r
        )
        self.cached_tokens = Counter(
            "inferflow_prompt_tokens_cached",
            "prompt tokens served from the prefix cache (usage.prompt_tokens_details.cached_tokens)",
            registry=r,
        )
        self.generation_tokens = Counter(
            "inferflow_generation_tokens", "generated tokens", registry=r
        )
        self.finished = Counter(
            "inferflow_request_finished",
            "finished samples by reason",
            ["finish_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "inferflow_time_to_first_token_seconds",
            "time to first token",
            buckets=LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "inferflow_inter_token_latency_seconds",
            "time between tokens",
            buckets=LATENCY,
            registry=r,
        )
        self.drafted = Gauge(
            "inferflow_spec_decode_draft_tokens",
            "speculative decoding: drafted tokens the model checked so far",
            registry=r,
        )
        self.accepted = Gauge(
            "inferflow_spec_decode_accepted_tokens",
            "speculative decoding: of those, tokens accepted",
            registry=r,
        )
        self.acceptance = Gauge(
            "inferflow_spec_decode_acceptance_ratio",
            "speculative decoding: accepted / drafted tokens so far (0 before any)",
            registry=r,
        )
        self.pauses = Gauge(
            "inferflow_spec_decode_pauses",
            "speculative decoding: times a request stopped drafting for its low acceptance",
            registry=r,
        )
        self.e2e = Histogram(
            "inferflow_e2e_request_latency_seconds", "request latency", buckets=LATENCY, registry=r
        )

    def engine_state(self, engine: Engine) -> None:
        s, alloc = engine.scheduler, engine.cache.alloc
        self.running.set(len(s.running))
        self.waiting.set(len(s.waiting))
        self.kv_free.set(alloc.num_free)
        self.kv_usage.set(1 - alloc.num_free / alloc.num_blocks)
        self.preemptions.set(s.preemptions)
        st = engine.spec_stats
        self.drafted.set(st.proposed)
        self.accepted.set(st.accepted)
        self.acceptance.set(st.acceptance_rate)
        self.pauses.set(st.pauses)
