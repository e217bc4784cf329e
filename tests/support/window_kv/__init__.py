"""What the window-sized KV tests share: Beam's layers in vLLM's own KV-cache grouping
(configs.py), the exact-window oracles (oracles.py), and vLLM's KV-cache manager with the device
buffers the groups share (pool.py)."""
