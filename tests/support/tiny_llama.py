"""A tiny random Llama whose model vocab (256) is larger than its tokenizer's (a few dozen ids),
with a SentencePiece-style (Metaspace) tokenizer: any id past the tokenizer's vocab is one the
tokenizer cannot decode, as with a real checkpoint whose embedding rows are padded."""
from __future__ import annotations

from pathlib import Path

MODEL_VOCAB = 256
WORDS = [f"w{i}" for i in range(40)]


def make_tiny_llama(out: Path) -> tuple[Path, int]:
    """Write the checkpoint; return (its directory, the tokenizer's vocab size)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in WORDS:
        vocab[f"▁{word}"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=256, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, len(vocab)
