"""A replica's counters from its Prometheus `/metrics` (vLLM 0.30.0's names).

Prefix-cache queries and hits are counted in prompt tokens (vLLM's `vllm:prefix_cache_queries`
and `vllm:prefix_cache_hits`); finished requests are `vllm:request_success`, summed over finish
reasons. Counters only grow, so a workload's share is the difference of two snapshots.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

QUERIES, HITS, REQUESTS = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:request_success"


@dataclass(frozen=True)
class Counters:
    queries: float  # prompt tokens looked up in the prefix cache
    hits: float  # of those, tokens found cached
    requests: float  # requests finished

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters(self.queries - other.queries, self.hits - other.hits, self.requests - other.requests)

    def __add__(self, other: "Counters") -> "Counters":
        return Counters(self.queries + other.queries, self.hits + other.hits, self.requests + other.requests)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def parse(text: str) -> Counters:
    totals = {QUERIES: 0.0, HITS: 0.0, REQUESTS: 0.0}
    seen = set()
    for family in text_string_to_metric_families(text):
        if family.name in totals:
            seen.add(family.name)
            totals[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    missing = sorted(set(totals) - seen)
    if missing:
        raise ValueError(f"/metrics lacks {', '.join(missing)} (not a vLLM 0.30 server, or prefix caching off?)")
    return Counters(totals[QUERIES], totals[HITS], totals[REQUESTS])


def read(base_url: str, timeout: float = 5.0) -> Counters:
    """Counters of the server at `base_url` (http://host:port, no /v1)."""
    with urllib.request.urlopen(f"{base_url.rstrip('/')}/metrics", timeout=timeout) as r:
        return parse(r.read().decode())


def replica_gauge(url: str, name: str) -> float:
    """The sum of gauge `name` (e.g. `vllm:num_requests_running`) over a replica's `/metrics` samples."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)
