"""What a tree's FP8 layer code needs from vLLM inside a fresh interpreter (tree.run_stubbed): one
tensor-parallel rank (vLLM's parameters ask their rank when created), and the VllmConfigs whose
current-config context the worker processes weights in, for the trained tiny Beam and a tiny
Llama (the model the port must leave as stock)."""
from pathlib import Path


def model_configs(out: str, tiny: str) -> dict:
    """{"beam": VllmConfig, "llama": VllmConfig}; `out` names the run's files (rank rendezvous,
    the Llama's config), `tiny` the Beam checkpoint (both models use its tokenizer)."""
    from transformers import LlamaConfig
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from beam_hpu.model.config import register_config

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="file://" + out + ".dist")
        initialize_model_parallel(1, 1)
    register_config()
    llama = Path(out + ".llama")
    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=256).save_pretrained(llama)
    return {m: VllmConfig(model_config=ModelConfig(model=path, tokenizer=tiny, dtype="bfloat16", max_model_len=256))
            for m, path in (("beam", tiny), ("llama", str(llama)))}
