"""Test-only: install the portable FP8 MoE method in every process of a vLLM engine (spawned
workers included), until the plugin's register() calls `beam_hpu.quant.portable_fp8_moe.install`."""

from beam_hpu.quant.portable_fp8_moe import install

install()
