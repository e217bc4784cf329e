"""KV pool arithmetic for Beam on the recipe's node: a full-context cache (today: every layer keeps
every token) against a window-sized cache (vLLM's hybrid groups: sliding layers keep only their
window), in bf16 and in FP8. Plain integer arithmetic with every input explicit; the grouping and
block counts follow vLLM 0.30's own rules (`kv_cache_utils._get_kv_cache_groups_uniform_page_size`,
`get_kv_cache_config_from_groups`), which tests/serving/test_kv_window.py checks against vLLM.

The one measured input is the pool the recipe reports today, 776,448 tokens (6,066 blocks of 128);
the KV bytes per card are derived from it, and the same bytes are then re-cut into blocks under the
other layouts. What is left out, and so not in any figure: vllm-gaudi's extra pad block per buffer,
per-token FP8 scales (the FP8 KV cache uses per-layer scales; `scale_bytes_per_token_layer` is 0 here),
and whether the smaller per-block page changes graph memory.

A window-sized cache only holds for the decode steps of sequences past their prefill: a sequence
prefilling a chunk of c tokens holds ceil((W - 2 + c) / bs) + 1 blocks per sliding group while it
runs (beam_hpu.runtime.window_kv.groups.sliding_blocks_bound), printed as the prefill reserve.

It also says which decode buckets of the recipe's file a batch can reach without sharing a prefix:
a window cache changes no bucket's blocks (the full layers' list is the same; the sliding layers'
window lists are 5 blocks a row either way), only which buckets the pool can fill.

Run: python -m serving.kv_window
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

# The recipe's figures (serving/recipe.yaml and Beam-1.0's config.json).
RECIPE_POOL_TOKENS = 776_448  # the KV pool vLLM reports for the recipe today (full-context cache)
BLOCK_SIZE = 128
NUM_LAYERS = 52
NUM_FULL_LAYERS = 9  # layer_types: full on every 6th layer and the last
SLIDING_WINDOW = 512
KV_HEADS_PER_CARD = 1  # 8 KV heads over tensor-parallel 8
HEAD_DIM = 128
MAX_NUM_SEQS = 16
MAX_MODEL_LEN = 262_144
MAX_NUM_BATCHED_TOKENS = 4096


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Layout:
    """How vLLM cuts the layers into KV-cache groups of equal size."""

    group_size: int  # layers per group = K/V buffers per card
    full_groups: int
    sliding_groups: int


def hybrid_layout(num_full: int, num_sliding: int) -> Layout:
    """vLLM 0.30's grouping for two attention kinds with one page size: groups of the smaller
    kind's layer count (of the larger's, when it is under 1.5 times the smaller), the last
    group of each kind padded."""
    if num_sliding == 0 or num_full == 0:
        return Layout(num_full + num_sliding, int(num_full > 0), int(num_sliding > 0))
    small, large = min(num_full, num_sliding), max(num_full, num_sliding)
    size = large if large < small * 1.5 else small
    return Layout(size, cdiv(num_full, size), cdiv(num_sliding, size))


def page_bytes(dtype_bytes: int, block_size: int = BLOCK_SIZE, kv_heads: int = KV_HEADS_PER_CARD,
               head_dim: int = HEAD_DIM, scale_bytes_per_token_layer: int = 0) -> int:
    """Bytes of one layer's K and V for one block on one card."""
    return block_size * (kv_heads * 2 * head_dim * dtype_bytes + scale_bytes_per_token_layer)


@dataclass(frozen=True)
class Pool:
    name: str
    num_blocks: int  # what vLLM allocates (the null block included)
    group_size: int
    sliding_groups: int

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1  # vLLM's BlockPool keeps block 0 as its null block

    def blocks_per_sequence(self, context: int, sliding_blocks: int) -> int:
        """Blocks one sequence of `context` tokens holds: every block in the full group, at most
        `sliding_blocks` in each sliding group."""
        if self.sliding_groups == 0:
            return cdiv(context, BLOCK_SIZE)
        return cdiv(context, BLOCK_SIZE) + self.sliding_groups * min(sliding_blocks, cdiv(context, BLOCK_SIZE))

    def longest_context(self, num_seqs: int, sliding_blocks: int, reserve_blocks: int = 0) -> int:
        """The longest context (tokens, a multiple of the block size) each of `num_seqs` sequences
        can hold at once in decode, with `reserve_blocks` kept back."""
        per_seq = (self.usable_blocks - reserve_blocks) // num_seqs - self.sliding_groups * sliding_blocks
        return max(0, per_seq) * BLOCK_SIZE

    def context_tokens(self, num_seqs: int, sliding_blocks: int) -> int:
        """Context tokens the pool holds for `num_seqs` long sequences: what is left for the full
        group after each sequence's sliding blocks (the figure comparable with today's pool)."""
        return (self.usable_blocks - num_seqs * self.sliding_groups * sliding_blocks) * BLOCK_SIZE


def kv_bytes_per_card(pool_tokens: int = RECIPE_POOL_TOKENS, num_layers: int = NUM_LAYERS) -> int:
    """The KV bytes one card holds today, from the measured full-context pool (bf16)."""
    return (pool_tokens // BLOCK_SIZE) * num_layers * page_bytes(2)


def pools(kv_bytes: int, num_layers: int = NUM_LAYERS, num_full: int = NUM_FULL_LAYERS) -> list[Pool]:
    """bf16 full, FP8 full, bf16 window, FP8 window over the same bytes."""
    window = hybrid_layout(num_full, num_layers - num_full)
    out = []
    for kind, group_size, sliding_groups in (("full", num_layers, 0), ("window", window.group_size,
                                                                          window.sliding_groups)):
        for dtype, dtype_bytes in (("bf16", 2), ("FP8", 1)):
            bytes_per_block = group_size * page_bytes(dtype_bytes)
            out.append(Pool(f"{dtype} {kind}", kv_bytes // bytes_per_block, group_size, sliding_groups))
    return sorted(out, key=lambda p: (p.sliding_groups > 0, p.name.startswith("FP8")))


def decode_sliding_blocks(window: int = SLIDING_WINDOW, block_size: int = BLOCK_SIZE) -> int:
    """Blocks a decoding sequence holds per sliding group: its window's (W - 1 keys before the
    query may start at a block's last slot)."""
    return cdiv(window - 1, block_size) + 1


def prefill_reserve(sliding_groups: int, chunk: int = MAX_NUM_BATCHED_TOKENS, window: int = SLIDING_WINDOW,
                    block_size: int = BLOCK_SIZE) -> int:
    """Extra blocks, over its decode window, one sequence holds in the sliding groups while it
    prefills a chunk."""
    during = cdiv(window - 2 + chunk, block_size) + 1
    return sliding_groups * (during - decode_sliding_blocks(window, block_size))


def unreachable_decode_buckets(pool: Pool, decode_buckets: list[tuple[int, int]],
                               sliding_blocks: int) -> list[tuple[int, int]]:
    """The (batch, blocks) decode buckets whose batch cannot hold that many full-group blocks at
    once in `pool` without sharing a prefix: blocks plus every sequence's sliding blocks exceed
    the usable pool. (The bucket's blocks are the full layers' block list; the sliding layers'
    window lists, 5 blocks a row, are the same with either cache.)"""
    return [(b, n) for b, n in decode_buckets
            if n + b * pool.sliding_groups * sliding_blocks > pool.usable_blocks]


def recipe_decode_buckets(bucket_file: str = "tp8-seqs16-256k.txt") -> list[tuple[int, int]]:
    from serving.lint_buckets import parse_bucket_text
    from serving.recipe import SERVING_DIR

    buckets, _ = parse_bucket_text((SERVING_DIR / bucket_file).read_text())
    return sorted({(b.batch, b.blocks) for b in buckets if b.query == 1})


def report(pool_tokens: int = RECIPE_POOL_TOKENS) -> str:
    kv_bytes = kv_bytes_per_card(pool_tokens)
    sw = decode_sliding_blocks()
    lines = [
        "# Inputs",
        f"measured full-context pool: {pool_tokens:,} tokens = {pool_tokens // BLOCK_SIZE:,} blocks of {BLOCK_SIZE}",
        f"layers {NUM_LAYERS} ({NUM_FULL_LAYERS} full, {NUM_LAYERS - NUM_FULL_LAYERS} sliding,"
        f" window {SLIDING_WINDOW}), {KV_HEADS_PER_CARD} KV head x {HEAD_DIM} per card,"
        " bf16 2 B / FP8 1 B per element, no FP8 scales",
        f"page (one layer, one block, K+V): bf16 {page_bytes(2):,} B, FP8 {page_bytes(1):,} B;"
        f" KV bytes per card {kv_bytes:,} ({kv_bytes / 2**30:.2f} GiB), the same in every layout",
        f"window layout (vLLM's grouping): {hybrid_layout(NUM_FULL_LAYERS, NUM_LAYERS - NUM_FULL_LAYERS)}",
        f"a decoding sequence holds {sw} blocks per sliding group; {MAX_NUM_SEQS} sequences, max-model-len"
        f" {MAX_MODEL_LEN:,}; prefill reserve = one sequence prefilling a {MAX_NUM_BATCHED_TOKENS}-token chunk",
        "",
        "| KV cache | blocks | pool (context tokens, 16 sequences) | x bf16 full | longest context, 16 sequences each"
        " | with a prefill reserve |",
        "|---|---|---|---|---|---|",
    ]
    base = None
    for pool in pools(kv_bytes):
        tokens = pool.context_tokens(MAX_NUM_SEQS, sw)
        base = base or tokens
        longest = pool.longest_context(MAX_NUM_SEQS, sw)
        reserved = pool.longest_context(MAX_NUM_SEQS, sw, prefill_reserve(pool.sliding_groups))
        lines.append(f"| {pool.name} | {pool.num_blocks:,} | {tokens:,} | {tokens / base:.2f} | {longest:,}"
                     f"{' (all 256K)' if longest >= MAX_MODEL_LEN else ''} | {reserved:,} |")
    decode = recipe_decode_buckets()
    lines += ["", "Decode buckets of the recipe's file (batch, blocks) no batch reaches without a shared prefix:"]
    for pool in pools(kv_bytes):
        lines.append(f"  {pool.name}: {unreachable_decode_buckets(pool, decode, sw) or 'none'}")
    lines.append("  (make_buckets.py leaves out the 128K tier from batch 8 because eight 128K sequences exceed"
                 " today's pool; under a window cache (8, 8192) and (16, 16384) are reachable, and adding them"
                 " makes 25 decode graphs, the recipe's max_decode_graphs)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool-tokens", type=int, default=RECIPE_POOL_TOKENS,
                        help="the full-context bf16 pool vLLM reports (tokens)")
    args = parser.parse_args(argv)
    print(report(args.pool_tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
