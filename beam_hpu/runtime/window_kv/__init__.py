"""A window-sized KV cache for Beam's sliding layers on vllm-gaudi."""
