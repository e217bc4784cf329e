"""KV tokens per replica at the recipe's memory figures, for bf16 and FP8 KV: a model, computed with
vLLM's own KV-cache sizing from the specs vllm-gaudi's runner emits.

    python -m serving.kv_capacity            # the tables, with every input and assumption printed

The chain, each step from the code that does it (vllm-gaudi 091bbadd, vLLM 0.30.0):
1. specs: `HPUModelRunner.get_kv_cache_spec` emits a `FullAttentionSpec(block_size, num_kv_heads,
   head_size, dtype=kv_cache_dtype)` for every decoder attention layer, the 43 sliding ones too
   (`layer_specs`; the window-sized variant hands its own specs to the same functions);
   dtype is the model dtype for `--kv-cache-dtype auto` and float8_e4m3fn for `fp8_inc`.
2. memory: `HPUWorker.determine_available_memory` takes the device memory free after the profile
   run, F, keeps F * gpu_memory_utilization, gives VLLM_GRAPH_RESERVED_MEM of that to HPU graphs,
   and reports the rest minus one dummy block (one page of every layer) (`kv_cache_bytes`);
3. blocks: vLLM's `get_kv_cache_config_from_groups` divides that by the bytes of one block of
   every layer (`pool_blocks`), and logs `num_blocks * block_size` as the KV cache size.
Under a window-sized KV cache (BEAM_WINDOW_KV=1) the 43 sliding layers get
`SlidingWindowSpec` (window 512; `window_layer_specs`, by beam_hpu.runtime.window_kv.groups's own rules) and
vLLM's `get_kv_cache_groups` forms 1 full + 5 sliding groups of 9 layers over 9 shared buffers, so
a block costs 9 layers' pages instead of 52; the same bytes are divided by vLLM's same function
(`pool_table`). A sequence then holds its context in the full group plus at most 5 blocks in each
sliding group (window_block_count): the pool's context tokens are what is left for the full group
once each of the 16 sequences holds its sliding blocks.
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

from beam_hpu.model.dflash2_sizes import DFlash2Sizes
from beam_hpu.runtime.sliding_window.hpu_window import window_block_count

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


def layer_specs(shape: AttentionShape, block_size: int, dtype: torch.dtype, first_layer: int = 0) -> dict:
    """layer name -> FullAttentionSpec, as HPUModelRunner.get_kv_cache_spec emits them."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(block_size=block_size,
                                                                  num_kv_heads=shape.kv_heads_per_card,
                                                                  head_size=shape.head_dim, dtype=dtype)
            for i in range(first_layer, first_layer + shape.num_layers)}


def drafter_specs(shape: AttentionShape, block_size: int, dtype: torch.dtype, layers: int) -> dict:
    """An EAGLE drafter's attention layers in the same runner: vLLM numbers them after the target's
    (model.layers.52...), each allocated as full attention whatever its own window
    (beam_hpu.runtime.window_kv.groups.allocation_windows). Assumed: Beam's KV shape (8 KV heads of 128), as
    EAGLE heads copy the target's attention config; no Beam drafter is published to check."""
    return layer_specs(AttentionShape(layers, shape.kv_heads, shape.head_dim, shape.tp), block_size, dtype,
                       first_layer=shape.num_layers) if layers else {}


# Beam-1.0's layer_types: full attention on every 6th layer and the last; the rest slide over 512.
BEAM_FULL_ATTENTION_LAYERS = frozenset(i for i in range(BEAM_501B_TP8.num_layers) if (i + 1) % 6 == 0
                                       or i == BEAM_501B_TP8.num_layers - 1)
BEAM_SLIDING_WINDOW = 512


def window_layer_specs(specs: dict, window: int = BEAM_SLIDING_WINDOW,
                       full_layers: frozenset = BEAM_FULL_ATTENTION_LAYERS) -> dict:
    """The specs under a window-sized cache: a SlidingWindowSpec for each sliding layer (in the
    order of `specs`, layer i), the FullAttentionSpec for the others."""
    from beam_hpu.runtime.window_kv.groups import allocation_windows, window_kv_spec

    windows = allocation_windows({name: None if i in full_layers else window for i, name in enumerate(specs)})
    return {name: window_kv_spec(spec, windows[name]) for name, spec in specs.items()}


def kv_bytes_per_token(specs: dict) -> float:
    """Per card, summed over layers (a layer's page holds block_size tokens of K and V)."""
    return sum(s.page_size_bytes / s.block_size for s in specs.values())


def kv_cache_bytes(specs: dict, memory: MemoryFigures) -> int:
    """What HPUWorker.determine_available_memory reports for the KV cache."""
    usable = memory.free_after_profile_bytes * memory.gpu_memory_utilization
    dummy_block = sum(s.page_size_bytes for s in specs.values())
    return int(usable * (1 - memory.graph_reserved) - dummy_block)


def _division_config(block_size: int) -> SimpleNamespace:
    """What vLLM's grouping and division read of the engine's config."""
    from vllm.config import AttentionConfig, CacheConfig

    cache = CacheConfig(block_size=block_size)
    cache.kv_cache_layout = "LBHNC"  # resolved by the engine core normally; the division ignores it
    return SimpleNamespace(cache_config=cache, attention_config=AttentionConfig(), speculative_config=None,
                           scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False))


def kv_cache_groups(specs: dict, block_size: int) -> list:
    """vLLM's own grouping (get_kv_cache_groups): one group of every layer for full specs alone,
    1 full + 5 sliding groups of 9 for Beam's window specs."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    return get_kv_cache_groups(_division_config(block_size), dict(specs))


def pool_blocks(specs: dict, available_bytes: int, block_size: int, groups: list | None = None) -> int:
    """vLLM's own division: get_kv_cache_config_from_groups over one group of every layer (or over
    the given groups)."""
    from vllm.v1.core.kv_cache_utils import create_kv_cache_group_specs, get_kv_cache_config_from_groups

    groups = groups or create_kv_cache_group_specs(specs, [list(specs)])
    return get_kv_cache_config_from_groups(_division_config(block_size), groups, available_bytes).num_blocks


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


def capacity(shape: AttentionShape, memory: MemoryFigures, block_size: int, dtype: torch.dtype,
             drafter_layers: int = 0) -> dict:
    specs = layer_specs(shape, block_size, dtype) | drafter_specs(shape, block_size, dtype, drafter_layers)
    available = kv_cache_bytes(specs, memory)
    blocks = pool_blocks(specs, available, block_size)
    return {"bytes_per_token": kv_bytes_per_token(specs), "kv_cache_bytes": available, "blocks": blocks,
            "tokens": blocks * block_size}


def window_capacity(shape: AttentionShape, memory: MemoryFigures, block_size: int, dtype: torch.dtype,
                    drafter_layers: int = 0) -> dict:
    """capacity() under a window-sized cache: the same worker split (its dummy block is one page of
    every layer either way), vLLM's grouping and division over the window specs. A drafter's layers
    join the full group, which makes every group that many layers wider (vLLM pads the sliding
    groups to the same width: 10 buffers for 9 + 1)."""
    specs = window_layer_specs(layer_specs(shape, block_size, dtype)) | drafter_specs(shape, block_size, dtype,
                                                                                      drafter_layers)
    groups = kv_cache_groups(specs, block_size)
    available = kv_cache_bytes(specs, memory)
    blocks = pool_blocks(specs, available, block_size, groups)
    sliding = sum(1 for g in groups if getattr(g.kv_cache_spec, "sliding_window", None) is not None)
    group_layers = max(len(g.layer_names) for g in groups)
    return {"kv_cache_bytes": available, "blocks": blocks, "sliding_groups": sliding,
            "bytes_per_token": group_layers * next(iter(specs.values())).page_size_bytes / block_size}


def context_tokens(blocks: int, block_size: int, sequences: int, sliding_groups: int, sliding_blocks: int) -> int:
    """Context tokens the pool holds once each of `sequences` sequences holds its sliding blocks
    (none under a full-context cache: then blocks x block_size, the figure vLLM logs)."""
    return (blocks - sequences * sliding_groups * sliding_blocks) * block_size


def longest_context(blocks: int, block_size: int, sequences: int, sliding_groups: int, sliding_blocks: int) -> int:
    """The longest context each of `sequences` sequences can hold at once, whole blocks, from the
    pool minus vLLM's null block, not capped at max_model_len."""
    return ((blocks - 1) // sequences - sliding_groups * sliding_blocks) * block_size


# The drafter's bytes a value: bf16, as the model builds its linears without a quantisation config.
DRAFTER_DTYPE_BYTES = 2


def dflash2_params_per_card(d: DFlash2Sizes, tp: int) -> dict[str, int]:
    """Parameters one card holds at TP `tp`: the attention and MLP linears are split by tp (vLLM's
    QKV / merged-column / row-parallel layers); fc, the convolutions' kernel projections, the
    selector (codebooks over the whole vocabulary) and the norms are replicated on every card."""
    H, D = d.hidden, d.head_dim
    attention = H * (d.q_heads + 2 * d.kv_heads) * D + d.q_heads * D * H
    mlp = 3 * H * d.intermediate
    conv = 2 * d.taps * H + 2 * d.taps * (H // d.conv_group) * H  # base kernels [2, taps, H] + projection
    per_layer_replicated = 2 * conv + 2 * D + 2 * H  # attention and MLP convs; q/k norms; two norms
    return {"split by TP (q/k/v/o, SwiGLU)": d.layers * (attention + mlp) // tp,
            "replicated (fc, conv projections, selector, norms)":
                d.layers * per_layer_replicated + len(d.target_layer_ids) * H * H + 2 * H + 2 * d.vocab * d.rank + d.rank * H}


def dflash2_context_bytes(d: DFlash2Sizes, tp: int | None = None) -> int:
    """One request's window of context keys and values: [layers, window, KV heads, head_dim] each;
    the whole node's (tp None) or one card's (KV heads split by tp, at least one)."""
    heads = d.kv_heads if tp is None else max(1, d.kv_heads // tp)
    return d.layers * d.window * heads * d.head_dim * 2 * DRAFTER_DTYPE_BYTES


def drafter_memory_lines(shape: AttentionShape = BEAM_501B_TP8, *, block_size: int = 128, sequences: int = 16,
                         free_bytes: float | None = None, drafter: DFlash2Sizes = DFlash2Sizes()) -> list[str]:
    """The DFlash2 drafter's bytes per card beside the KV pool: its weights and each request's
    context window (kept by the proposer, outside vLLM's KV cache), and the bf16 pool it costs when
    allocated before the profile run (F smaller by it; the worker's split and vLLM's division as
    for the pool)."""
    if free_bytes is None:
        free_bytes = free_from_graph_reserve(RECIPE_GRAPH_RESERVE_GIB, MemoryFigures(0.0))
    tp = shape.tp
    params = dflash2_params_per_card(drafter, tp)
    weights = sum(params.values()) * DRAFTER_DTYPE_BYTES
    node_request, card_request = dflash2_context_bytes(drafter), dflash2_context_bytes(drafter, tp)
    context = sequences * card_request
    memory = MemoryFigures(free_bytes)
    without = capacity(shape, memory, block_size, torch.bfloat16)
    rows = {"weights": weights, "context windows": context, "weights + context windows": weights + context}
    lines = [f"DFlash2 drafter beside it (`--speculative-config dflash`), a model: bf16, TP {tp}, "
             f"--max-num-seqs {sequences}, at the central F ({free_bytes / GIB:.3f} GiB)",
             f"weights per card: {', '.join(f'{n} {c / 1e6:,.1f}M' for n, c in params.items())} parameters x "
             f"{DRAFTER_DTYPE_BYTES} bytes = {weights / 1e6:,.1f} MB (the whole drafter: "
             f"{sum(dflash2_params_per_card(drafter, 1).values()) / 1e9:.2f}B parameters)",
             f"context window per request: {drafter.layers} layers x {drafter.window:,} tokens x "
             f"{drafter.kv_heads} KV heads x {drafter.head_dim} x 2 (K, V) x {DRAFTER_DTYPE_BYTES} bytes = "
             f"{node_request / 1e6:.1f} MB on the node, {card_request / 1e6:.1f} MB a card "
             f"({max(1, drafter.kv_heads // tp)} KV head); x {sequences} = {context / 1e6:.1f} MB a card "
             "(positions and flags not counted)",
             f"if allocated after the KV cache is sized it must fit in what the worker leaves outside "
             f"--gpu-memory-utilization: {free_bytes * (1 - memory.gpu_memory_utilization) / GIB:.2f} GiB a card",
             "", f"| allocated before the profile run | bytes a card | bf16 pool blocks | pool tokens | "
             f"pool lost |", "|---|---|---|---|---|",
             f"| nothing (the recipe) | 0 | {without['blocks']:,} | {without['tokens']:,} | 0 |"]
    for name, nbytes in rows.items():
        c = capacity(shape, MemoryFigures(free_bytes - nbytes), block_size, torch.bfloat16)
        lost = without["tokens"] - c["tokens"]
        lines.append(f"| {name} | {nbytes / 1e6:,.1f} MB | {c['blocks']:,} | {c['tokens']:,} | "
                     f"{lost:,} tokens ({lost / without['tokens']:.1%}) |")
    return lines


POOL_ROWS = (  # (name, window-sized, KV dtype, drafter layers)
    ("bf16 full", False, torch.bfloat16, 0), ("FP8 full", False, torch.float8_e4m3fn, 0),
    ("bf16 window", True, torch.bfloat16, 0), ("FP8 window", True, torch.float8_e4m3fn, 0),
    ("bf16 full + EAGLE layer", False, torch.bfloat16, 1), ("bf16 window + EAGLE layer", True, torch.bfloat16, 1),
    ("FP8 window + EAGLE layer", True, torch.float8_e4m3fn, 1),
)


def pool_table(shape: AttentionShape = BEAM_501B_TP8, *, block_size: int = 128, max_model_len: int = 262_144,
               sequences: int = 16, free_bytes: float | None = None) -> list[str]:
    """bf16 full, FP8 full, bf16 window, FP8 window, and with a one-layer EAGLE drafter beside Beam
    (vLLM's speculative config only marks the drafter's group, it does not change the division): blocks, the pool's context tokens, and the longest context each of `sequences` sequences
    holds, at the central F of the recipe's figures."""
    if free_bytes is None:
        free_bytes = free_from_graph_reserve(RECIPE_GRAPH_RESERVE_GIB, MemoryFigures(0.0))
    memory = MemoryFigures(free_bytes)
    sliding_blocks = window_block_count(BEAM_SLIDING_WINDOW, block_size)
    lines = [f"| KV cache | bytes / context token / card | blocks | pool (context tokens, {sequences} sequences) "
             f"| x bf16 full | longest context, {sequences} sequences each |", "|---|---|---|---|---|---|"]
    base = None
    for name, window, dtype, drafter_layers in POOL_ROWS:
        if not window:
            c = capacity(shape, memory, block_size, dtype, drafter_layers)
            c["sliding_groups"] = 0
        else:
            c = window_capacity(shape, memory, block_size, dtype, drafter_layers)
        pool = context_tokens(c["blocks"], block_size, sequences, c["sliding_groups"], sliding_blocks)
        base = base or pool
        longest = longest_context(c["blocks"], block_size, sequences, c["sliding_groups"], sliding_blocks)
        every = f" (all {max_model_len // 1024}K)" if longest >= max_model_len else ""
        lines.append(f"| {name} | {c['bytes_per_token']:,.0f} | {c['blocks']:,} | {pool:,} | "
                     f"{pool / base:.2f} | {longest:,}{every} |")
    return lines


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
    sliding_blocks = window_block_count(BEAM_SLIDING_WINDOW, block_size)
    lines += ["", "Full-context against window-sized cache (BEAM_WINDOW_KV=1: the full group's 9 layers' K/V a "
              f"context token, each sequence also holding at most {sliding_blocks} blocks in each sliding group), "
              "at the central F; the '+ EAGLE layer' rows add a one-layer EAGLE drafter of Beam's KV shape "
              "(assumed), which joins the full group and makes every group 10 layers wide:", ""]
    lines += pool_table(shape, block_size=block_size, max_model_len=max_model_len, sequences=sequences,
                        free_bytes=frees[1])
    lines += [""] + drafter_memory_lines(shape, block_size=block_size, sequences=sequences, free_bytes=frees[1])
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
