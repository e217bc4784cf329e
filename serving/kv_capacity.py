"""KV tokens per replica at the recipe's memory figures, for bf16 and FP8 KV: a model, computed with
vLLM's own KV-cache sizing from the specs vllm-gaudi's runner emits.

    python -m serving.kv_capacity            # the table, with every input and assumption printed

The chain, each step from the code that does it (vllm-gaudi 091bbadd, vLLM 0.30.0):
1. specs: `HPUModelRunner.get_kv_cache_spec` emits a `FullAttentionSpec(block_size, num_kv_heads,
   head_size, dtype=kv_cache_dtype)` for every decoder attention layer, the 43 sliding ones too
   (`layer_specs`; issue 26's window-sized variant hands its own specs to the same functions);
   dtype is the model dtype for `--kv-cache-dtype auto` and float8_e4m3fn for `fp8_inc`.
2. memory: `HPUWorker.determine_available_memory` takes the device memory free after the profile
   run, F, keeps F * gpu_memory_utilization, gives VLLM_GRAPH_RESERVED_MEM of that to HPU graphs,
   and reports the rest minus one dummy block (one page of every layer) (`kv_cache_bytes`);
3. blocks: vLLM's `get_kv_cache_config_from_groups` divides that by the bytes of one block of
   every layer (`pool_blocks`), and logs `num_blocks * block_size` as the KV cache size.
The one input this cannot know on CPU is F (per-card HBM minus the weights, the runtime and the
profile run's peak workspace): the recipe prints only its graph share, 12.84 GiB = F * 0.90 * 0.4,
rounded to 0.01 GiB, so F is known to that interval and the pool to a few blocks of it
(`free_from_graph_reserve`). HBM and weights per card are printed as context, not used. The FP8
figure assumes the same F: whether the FP8 attention's profile-run workspace or graphs differ on a
card is not known here (a card run prints `Free device memory` and `KV cache size`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import SimpleNamespace

import torch

GIB = 2**30
RECIPE_POOL_TOKENS = 776_448  # the published recipe's "KV pool ... per replica"
RECIPE_GRAPH_RESERVE_GIB = 12.84  # "VLLM_GRAPH_RESERVED_MEM=0.4 leaves 12.84 GiB per card for graphs"
RECIPE_GRAPH_RESERVE_ROUNDING_GIB = 0.005  # printed to two decimals


@dataclass(frozen=True)
class AttentionShape:
    """A model's attention as the KV cache sees it, per card."""

    num_layers: int
    kv_heads: int  # total; per card max(1, kv_heads // tp)
    head_dim: int
    tp: int

    @property
    def kv_heads_per_card(self) -> int:
        return max(1, self.kv_heads // self.tp)


# Beam-1.0-501B-A23B (../shared/REFERENCE.md): 52 layers, 8 KV heads of 128, at the recipe's TP 8.
BEAM_501B_TP8 = AttentionShape(num_layers=52, kv_heads=8, head_dim=128, tp=8)
KV_DTYPES = {"bf16 (auto)": torch.bfloat16, "fp8 (fp8_inc)": torch.float8_e4m3fn}


@dataclass(frozen=True)
class MemoryFigures:
    free_after_profile_bytes: float  # F, per card
    gpu_memory_utilization: float = 0.90
    graph_reserved: float = 0.4  # VLLM_GRAPH_RESERVED_MEM


def layer_specs(shape: AttentionShape, block_size: int, dtype: torch.dtype) -> dict:
    """layer name -> FullAttentionSpec, as HPUModelRunner.get_kv_cache_spec emits them."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(block_size=block_size,
                                                                  num_kv_heads=shape.kv_heads_per_card,
                                                                  head_size=shape.head_dim, dtype=dtype)
            for i in range(shape.num_layers)}


def kv_bytes_per_token(specs: dict) -> float:
    """Per card, summed over layers (a layer's page holds block_size tokens of K and V)."""
    return sum(s.page_size_bytes / s.block_size for s in specs.values())


def kv_cache_bytes(specs: dict, memory: MemoryFigures) -> int:
    """What HPUWorker.determine_available_memory reports for the KV cache."""
    usable = memory.free_after_profile_bytes * memory.gpu_memory_utilization
    dummy_block = sum(s.page_size_bytes for s in specs.values())
    return int(usable * (1 - memory.graph_reserved) - dummy_block)


def pool_blocks(specs: dict, available_bytes: int, block_size: int) -> int:
    """vLLM's own division: get_kv_cache_config_from_groups over one group of every layer."""
    from vllm.config import AttentionConfig, CacheConfig
    from vllm.v1.core.kv_cache_utils import create_kv_cache_group_specs, get_kv_cache_config_from_groups

    cache = CacheConfig(block_size=block_size)
    cache.kv_cache_layout = "LBHNC"  # resolved by the engine core normally; the division ignores it
    config = SimpleNamespace(cache_config=cache, attention_config=AttentionConfig())  # what the function reads
    groups = create_kv_cache_group_specs(specs, [list(specs)])
    return get_kv_cache_config_from_groups(config, groups, available_bytes).num_blocks


def free_from_graph_reserve(graph_gib: float, memory: MemoryFigures) -> float:
    """F from the graph share the worker logs: graph = F * utilization * graph_reserved."""
    return graph_gib * GIB / (memory.gpu_memory_utilization * memory.graph_reserved)


def free_for_blocks(specs: dict, blocks: int, memory: MemoryFigures) -> tuple[float, float]:
    """[lo, hi) of F (bytes) for which the worker's split and vLLM's division give exactly `blocks`."""
    per_block = sum(s.page_size_bytes for s in specs.values())  # one block of every layer (= the dummy)
    share = memory.gpu_memory_utilization * (1 - memory.graph_reserved)
    return (blocks * per_block + per_block) / share, ((blocks + 1) * per_block + per_block) / share


def per_sequence_tokens(blocks: int, block_size: int, sequences: int, max_model_len: int) -> int:
    """The longest context each of `sequences` sequences can hold at once: whole blocks each, from
    the pool minus vLLM's null block, at most max_model_len."""
    return min(max_model_len, (blocks - 1) // sequences * block_size)


def capacity(shape: AttentionShape, memory: MemoryFigures, block_size: int, dtype: torch.dtype) -> dict:
    specs = layer_specs(shape, block_size, dtype)
    available = kv_cache_bytes(specs, memory)
    blocks = pool_blocks(specs, available, block_size)
    return {"bytes_per_token": kv_bytes_per_token(specs), "kv_cache_bytes": available, "blocks": blocks,
            "tokens": blocks * block_size}


def recipe_table(shape: AttentionShape = BEAM_501B_TP8, *, block_size: int = 128, max_model_len: int = 262_144,
                 sequences: int = 16, utilization: float = 0.90, graph_reserved: float = 0.4) -> str:
    rows = []
    lo, mid, hi = (RECIPE_GRAPH_RESERVE_GIB + d for d in (-RECIPE_GRAPH_RESERVE_ROUNDING_GIB, 0.0,
                                                         RECIPE_GRAPH_RESERVE_ROUNDING_GIB))
    base = MemoryFigures(0.0, utilization, graph_reserved)
    frees = [free_from_graph_reserve(g, base) for g in (lo, mid, hi)]
    lines = [
        "KV cache per replica (one 8-card node), a model: vLLM 0.30.0's block division over the specs "
        "vllm-gaudi's HPUModelRunner emits, with HPUWorker's memory split.",
        f"inputs: {shape.num_layers} attention layers, each a FullAttentionSpec (sliding layers too), "
        f"{shape.kv_heads} KV heads / TP {shape.tp} = {shape.kv_heads_per_card} per card, head_dim "
        f"{shape.head_dim}, --block-size {block_size}, --gpu-memory-utilization {utilization:.2f}, "
        f"VLLM_GRAPH_RESERVED_MEM {graph_reserved}, --max-model-len {max_model_len:,}, --max-num-seqs {sequences}",
        f"unknown here: F, the device memory free after the profile run (per-card HBM minus weights "
        f"(503 GB / 8 = {503e9 / 8 / GIB:.1f} GiB of FP8 checkpoint), runtime and profile workspace). "
        f"Taken from the recipe's graph share {RECIPE_GRAPH_RESERVE_GIB} GiB (+-{RECIPE_GRAPH_RESERVE_ROUNDING_GIB}): "
        f"F = {frees[0] / GIB:.3f} .. {frees[2] / GIB:.3f} GiB",
        "assumed: the same F with FP8 KV (its profile workspace and graphs are not measured)",
        "",
        "| KV dtype | bytes / token / card | KV cache per card | blocks | pool tokens | "
        f"per sequence at {sequences} sequences |",
        "|---|---|---|---|---|---|",
    ]
    for name, dtype in KV_DTYPES.items():
        results = [capacity(shape, MemoryFigures(f, utilization, graph_reserved), block_size, dtype) for f in frees]
        low, central, high = results
        rows.append((name, central))
        lines.append(f"| {name} | {central['bytes_per_token']:,.0f} | {central['kv_cache_bytes'] / GIB:.3f} GiB | "
                     f"{central['blocks']:,} ({low['blocks']:,} .. {high['blocks']:,}) | "
                     f"{central['tokens']:,} ({low['tokens']:,} .. {high['tokens']:,}) | "
                     f"{per_sequence_tokens(central['blocks'], block_size, sequences, max_model_len):,} "
                     f"({per_sequence_tokens(low['blocks'], block_size, sequences, max_model_len):,} .. "
                     f"{per_sequence_tokens(high['blocks'], block_size, sequences, max_model_len):,}) |")
    bf16 = [capacity(shape, MemoryFigures(f, utilization, graph_reserved), block_size, torch.bfloat16)["tokens"]
            for f in (frees[0], frees[2])]
    inside = bf16[0] <= RECIPE_POOL_TOKENS <= bf16[1]
    exact = free_for_blocks(layer_specs(shape, block_size, torch.bfloat16), RECIPE_POOL_TOKENS // block_size, base)
    lines += ["", f"recipe's bf16 pool {RECIPE_POOL_TOKENS:,} tokens ({RECIPE_POOL_TOKENS // block_size:,} blocks): "
              f"{'inside' if inside else 'OUTSIDE'} the interval the rounded graph share allows; it is exactly "
              f"reproduced for F in [{exact[0] / GIB:.4f}, {exact[1] / GIB:.4f}) GiB, which the printed figure "
              f"cannot pin down (the worker's `Free device memory` log line on the card does)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--free-gib", type=float, default=None,
                   help="F, the free device memory after the profile run (the worker logs it), instead of "
                        "deriving it from the recipe's graph share")
    p.add_argument("--sequences", type=int, default=16)
    args = p.parse_args(argv)
    if args.free_gib is None:
        print(recipe_table(sequences=args.sequences))
        return 0
    memory = MemoryFigures(args.free_gib * GIB)
    for name, dtype in KV_DTYPES.items():
        c = capacity(BEAM_501B_TP8, memory, 128, dtype)
        print(f"{name}: {c['blocks']:,} blocks, {c['tokens']:,} tokens, "
              f"{per_sequence_tokens(c['blocks'], 128, args.sequences, 262_144):,} per sequence at {args.sequences}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
