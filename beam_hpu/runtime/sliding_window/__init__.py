"""Exact sliding windows over vllm-gaudi's paged KV cache."""
