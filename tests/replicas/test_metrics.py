"""Prefix-cache counters parsed from Prometheus text as vLLM 0.30.0 exposes it."""

import pytest

from beam_hpu.replicas.metrics import Counters, parse

TEXT = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="beam-tiny"} 1024.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="beam-tiny"} 768.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="beam-tiny"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="beam-tiny"} 2.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="beam-tiny"} 0.0
"""


def test_parse_sums_the_counters():
    c = parse(TEXT)
    assert c == Counters(1024.0, 768.0, 5.0) and c.hit_rate == 0.75
    assert (c - Counters(1000.0, 768.0, 4.0)) == Counters(24.0, 0.0, 1.0)


def test_missing_counter_is_named():
    with pytest.raises(ValueError, match="vllm:prefix_cache_hits"):
        parse(TEXT.replace("prefix_cache_hits", "something_else"))
