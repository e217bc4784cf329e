"""Beam as a vLLM model: `config` (BeamConfig and the checks vLLM needs before it builds a model),
`beam` (BeamForCausalLM from vLLM's layers), `ops` (element-wise arithmetic shared with the CPU
FP8 experts)."""
