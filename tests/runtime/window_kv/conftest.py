"""Fixtures of the window-KV tree tests: Beam's 52 attention layers in a vLLM config, unbound from
their KV caches after each test that binds them."""
import pytest
import torch

from tests.support.gaudi.window_kv_cache import beam_vllm_config


@pytest.fixture(scope="module")
def beam_config():
    return beam_vllm_config()


@pytest.fixture
def unbound(beam_config):
    yield
    for layer in beam_config.compilation_config.static_forward_context.values():
        layer.kv_cache = torch.tensor([])
