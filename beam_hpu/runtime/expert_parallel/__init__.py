"""Expert parallel on vLLM-CPU's unquantised experts."""
