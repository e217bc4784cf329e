"""Replicas of the tiny Beam behind the vLLM project's router (`vllm-router`), on CPU.

`layout.py`: ports, core bindings and command lines; `supervisor.py`: start, health, stop;
`demo.py`: `beam-hpu demo --replicas N`; `metrics.py`: prefix-cache counters from a replica's
/metrics. `serving/multinode.md` lays the same out for several Gaudi nodes.
"""
