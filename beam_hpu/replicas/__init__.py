"""Replicas of Beam behind the vLLM project's router (`vllm-router`).

`layout.py`: ports, core bindings and command lines (replicas: the demo's `vllm serve`; the
router: its flags and why); `supervisor.py`: start, health, kill/restart, stop (process groups);
`demo.py`: `beam-hpu demo --replicas N`; `metrics.py`: a replica's prefix-cache and request
counters from /metrics; `multinode.py`: the router's command for N Gaudi nodes
(serving/multinode.md).
"""
