"""The tiny DFlash2 drafter's files load into the served model by their published names, and the
trainer's block forward (`TinyDFlash2`) computes what the served model computes."""

import json
from types import SimpleNamespace

import pytest
import torch

from beam_hpu.tiny.dflash2_drafter import DFlash2Shape, TinyDFlash2, init_drafter, read_dflash2, write_dflash2
from tests.support.dflash2_served import one_rank


@pytest.fixture(scope="module")
def vllm_ready():
    from vllm.config import VllmConfig, set_current_vllm_config

    one_rank()
    with set_current_vllm_config(VllmConfig()):
        yield


def test_init_is_deterministic():
    a, b = init_drafter(seed=3).published(), init_drafter(seed=3).published()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc.weight"], init_drafter(seed=4).published()["fc.weight"])


def test_published_tensors_load_back():
    a = init_drafter(seed=3)
    b = init_drafter(seed=4).load_published(a.published())
    assert all(torch.equal(x, y) for x, y in zip(a.published().values(), b.published().values()))


def test_config_keeps_the_drafter_fields_through_transformers(tmp_path):
    """transformers' Qwen3Config drops `sliding_window` unless `use_sliding_window`: the written
    config must come back with every field the served model reads."""
    from transformers import AutoConfig

    from beam_hpu.model.dflash2 import validate_dflash2_config

    write_dflash2(tmp_path, init_drafter(), {})
    cfg = AutoConfig.from_pretrained(str(tmp_path))
    validate_dflash2_config(cfg)
    assert cfg.sliding_window == DFlash2Shape().sliding_window
    assert cfg.architectures == ["DFlash2BeamDraftModel"]


def test_served_model_computes_the_trainers_block(tmp_path, vllm_ready):
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    from beam_hpu.model.dflash2 import DFlash2BeamForCausalLM, DFlash2Context, target_aux_layer_ids

    torch.manual_seed(0)
    tiny = init_drafter(seed=1)
    with torch.no_grad():  # move off the identity start so the convolutions count
        for name, p in tiny.named_parameters():
            if "kernel_projection" in name or "base_kernel" in name:
                p.add_(0.3 * torch.randn_like(p))
    write_dflash2(tmp_path, tiny, {})
    cfg = SimpleNamespace(**json.loads((tmp_path / "config.json").read_text()))
    model = DFlash2BeamForCausalLM(vllm_config=SimpleNamespace(model_config=SimpleNamespace(hf_config=cfg)))
    loaded = model.load_weights(read_dflash2(tmp_path).items())
    assert loaded == {n for n, _ in model.named_parameters()}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(module)
    assert target_aux_layer_ids(cfg) == [1, 3, 5]  # the EAGLE3 drafter's AUX_LAYERS

    s, C, B = tiny.shape, 40, 4
    H = s.hidden_size
    aux = torch.randn(1, C, 3 * H)
    ctx_pos = torch.arange(C)[None]
    valid = torch.ones(1, C, dtype=torch.bool)
    embeds = torch.randn(1, B, H)
    pos = C + torch.arange(B)[None]
    with torch.no_grad():
        k, v = tiny.context(aux, ctx_pos)
        want = tiny.block(embeds, pos, k, v, ctx_pos, valid)
        sk, sv = model.context_kv(model.combine_hidden_states(aux[0]), ctx_pos[0])
        got = model(None, pos, DFlash2Context(sk[:, None], sv[:, None], ctx_pos, valid), inputs_embeds=embeds)
    assert (got - want).abs().max() <= 1e-4
