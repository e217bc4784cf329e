"""serving/kv_capacity.py: vLLM's own block division over the HPU runner's specs reproduces the
recipe's 776,448-token bf16 pool from its memory figures, and FP8 KV halves the bytes per token."""

import torch

from beam_hpu.model.dflash2_sizes import DFlash2Sizes
from serving import kv_capacity as kc

GIB = 2**30


def test_vllms_division_is_the_bytes_of_one_block_of_every_layer():
    shape = kc.AttentionShape(num_layers=7, kv_heads=4, head_dim=64, tp=2)
    for dtype, itemsize in ((torch.bfloat16, 2), (torch.float8_e4m3fn, 1)):
        specs = kc.layer_specs(shape, 32, dtype)
        page = 2 * 32 * 2 * 64 * itemsize  # K and V, block 32, 2 KV heads per card
        assert kc.kv_bytes_per_token(specs) == 7 * page / 32
        for available in (page * 7 * 10, page * 7 * 10 + page * 7 - 1, 123_456_789):
            assert kc.pool_blocks(specs, available, 32) == available // (7 * page)


def test_the_workers_split_leaves_the_graph_share_and_one_dummy_block():
    specs = kc.layer_specs(kc.BEAM_501B_TP8, 128, torch.bfloat16)
    memory = kc.MemoryFigures(40 * GIB)
    dummy = 52 * 2 * 128 * 128 * 2
    assert kc.kv_cache_bytes(specs, memory) == int(40 * GIB * 0.9 * 0.6 - dummy)


def test_the_recipes_bf16_pool_is_reproduced_from_its_figures():
    base = kc.MemoryFigures(0.0)
    lo, hi = (kc.free_from_graph_reserve(g, base) for g in (12.835, 12.845))
    bf16 = [kc.capacity(kc.BEAM_501B_TP8, kc.MemoryFigures(f), 128, torch.bfloat16)["tokens"] for f in (lo, hi)]
    assert bf16[0] <= kc.RECIPE_POOL_TOKENS <= bf16[1]
    assert bf16[1] - bf16[0] <= 8 * 128  # the rounding of 12.84 GiB costs a few blocks, not more
    specs = kc.layer_specs(kc.BEAM_501B_TP8, 128, torch.bfloat16)
    f_lo, f_hi = kc.free_for_blocks(specs, 6066, base)
    assert lo < f_lo < f_hi < hi
    for f in (f_lo + 1, (f_lo + f_hi) / 2, f_hi - 1):  # one byte inside either end (float products)
        assert kc.capacity(kc.BEAM_501B_TP8, kc.MemoryFigures(f), 128, torch.bfloat16)["tokens"] == 776_448
    assert kc.capacity(kc.BEAM_501B_TP8, kc.MemoryFigures(f_hi + 1), 128, torch.bfloat16)["tokens"] == 776_576


def test_fp8_kv_doubles_the_pool_and_the_context_of_16_sequences():
    f = sum(kc.free_for_blocks(kc.layer_specs(kc.BEAM_501B_TP8, 128, torch.bfloat16), 6066, kc.MemoryFigures(0.0))) / 2
    bf16, fp8 = (kc.capacity(kc.BEAM_501B_TP8, kc.MemoryFigures(f), 128, d)
                 for d in (torch.bfloat16, torch.float8_e4m3fn))
    assert fp8["bytes_per_token"] * 2 == bf16["bytes_per_token"] == 26_624
    assert 2 * bf16["blocks"] <= fp8["blocks"] <= 2 * bf16["blocks"] + 2
    assert kc.per_sequence_tokens(bf16["blocks"], 128, 16, 262_144) == 48_512
    assert kc.per_sequence_tokens(fp8["blocks"], 128, 16, 262_144) == 97_024
    assert kc.per_sequence_tokens(10**9, 128, 16, 262_144) == 262_144


def test_the_table_prints_its_inputs_and_the_unknown_one(capsys):
    assert kc.main([]) == 0
    out = capsys.readouterr().out
    for text in ("a model", "unknown here: F", "VLLM_GRAPH_RESERVED_MEM 0.4", "--gpu-memory-utilization 0.90",
                 "bf16 (auto) | 26,624", "fp8 (fp8_inc) | 13,312", "776,448 tokens (6,066 blocks): inside"):
        assert text in out, text


def test_kv_capacity_and_kv_window_agree_on_the_full_caches():
    """serving/kv_window.py re-cuts the bytes of the measured 6,066-block pool; this module
    derives the pool from the memory split. At an F that gives 6,066 bf16 blocks both agree on the
    bf16 pool; on FP8's this module finds 1 to 3 blocks more: the FP8 dummy block is half the bf16 one
    (+1), and the bytes left under one bf16 block are up to two FP8 blocks (kv_window drops them). FP8 KV here
    has static per-layer scales only: no per-token scale bytes (kv_window's scale_bytes 0 is right)."""
    from serving import kv_window as kw

    specs = kc.layer_specs(kc.BEAM_501B_TP8, 128, torch.bfloat16)
    lo, hi = kc.free_for_blocks(specs, 6066, kc.MemoryFigures(0.0))
    window = {p.name: p.num_blocks for p in kw.pools(kw.kv_bytes_per_card())}
    for f in (lo + 1, hi - 1):
        ours = {d: kc.capacity(kc.BEAM_501B_TP8, kc.MemoryFigures(f), 128, dtype)["blocks"]
                for d, dtype in (("bf16", torch.bfloat16), ("FP8", torch.float8_e4m3fn))}
        assert ours["bf16"] == window["bf16 full"] == 6066
        assert window["FP8 full"] + 1 <= ours["FP8"] <= window["FP8 full"] + 3
    assert kc.kv_bytes_per_token(kc.layer_specs(kc.BEAM_501B_TP8, 128, torch.float8_e4m3fn)) * 128 == \
        kw.NUM_LAYERS * kw.page_bytes(1)


def test_the_window_cache_groups_like_vllm_and_holds_over_5x_the_bf16_full_pool():
    full = kc.layer_specs(kc.BEAM_501B_TP8, 128, torch.bfloat16)
    window = kc.window_layer_specs(full)
    assert sum(getattr(s, "sliding_window", None) == 512 for s in window.values()) == 43
    groups = kc.kv_cache_groups(window, 128)
    assert sorted(len(g.layer_names) for g in groups) == [8, 8, 9, 9, 9, 9]
    f = kc.free_from_graph_reserve(kc.RECIPE_GRAPH_RESERVE_GIB, kc.MemoryFigures(0.0))
    bf16 = kc.capacity(kc.BEAM_501B_TP8, kc.MemoryFigures(f), 128, torch.bfloat16)
    win = kc.window_capacity(kc.BEAM_501B_TP8, kc.MemoryFigures(f), 128, torch.bfloat16)
    fp8 = kc.window_capacity(kc.BEAM_501B_TP8, kc.MemoryFigures(f), 128, torch.float8_e4m3fn)
    assert win["sliding_groups"] == 5 and win["bytes_per_token"] == 9 * 512
    # The same bytes over 9 layers' pages instead of 52.
    assert bf16["blocks"] * 52 // 9 <= win["blocks"] <= (bf16["blocks"] + 1) * 52 // 9
    # FP8 halves the page; the worker's dummy block (one page of all 52 layers) is half as many
    # bytes too, which leaves 26 FP8 pages' bytes more: about 52/9 = 6 FP8 window blocks.
    assert 2 * win["blocks"] <= fp8["blocks"] <= 2 * win["blocks"] + 8
    pool = kc.context_tokens(win["blocks"], 128, 16, 5, 5)
    assert pool >= 5 * bf16["tokens"]
    assert kc.longest_context(win["blocks"], 128, 16, 5, 5) >= 262_144  # 16 sequences at 256K
    assert kc.longest_context(bf16["blocks"], 128, 16, 0, 5) == 48_512


def test_the_pool_table_prints_the_four_caches(capsys):
    assert kc.main([]) == 0
    out = capsys.readouterr().out
    names = ("bf16 full", "FP8 full", "bf16 window", "FP8 window")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in out.splitlines()
            if line.split(" | ")[0].lstrip("| ") in names}
    assert set(rows) == {"bf16 full", "FP8 full", "bf16 window", "FP8 window"}
    ratio = float(rows["bf16 window"].split(" | ")[4])
    assert ratio >= 5 and "(all 256K)" in rows["bf16 window"] and "(all 256K)" in rows["FP8 window"]
    assert "\n".join(kc.pool_table()) in out  # the README's generated table is this one


def test_an_eagle_drafter_layer_widens_every_window_group_to_10_layers():
    """The drafter's layer joins the full group; vLLM pads the five sliding groups to the same width,
    so a block costs 10 layers' pages instead of 9 and the bf16 window pool no longer holds 16
    sequences at 256K (FP8 still does)."""
    f = kc.free_from_graph_reserve(kc.RECIPE_GRAPH_RESERVE_GIB, kc.MemoryFigures(0.0))
    specs = kc.window_layer_specs(kc.layer_specs(kc.BEAM_501B_TP8, 128, torch.bfloat16)) | \
        kc.drafter_specs(kc.BEAM_501B_TP8, 128, torch.bfloat16, 1)
    assert "model.layers.52.self_attn.attn" in specs and len(specs) == 53
    groups = kc.kv_cache_groups(specs, 128)
    full = [g for g in groups if getattr(g.kv_cache_spec, "sliding_window", None) is None]
    assert len(groups) == 6 and len(full) == 1 and len(full[0].layer_names) == 10
    win = kc.window_capacity(kc.BEAM_501B_TP8, kc.MemoryFigures(f), 128, torch.bfloat16)
    eagle = kc.window_capacity(kc.BEAM_501B_TP8, kc.MemoryFigures(f), 128, torch.bfloat16, drafter_layers=1)
    assert eagle["bytes_per_token"] == 10 * 512 and eagle["sliding_groups"] == 5
    assert win["blocks"] * 9 // 10 - 1 <= eagle["blocks"] <= win["blocks"] * 9 // 10 + 1
    assert kc.longest_context(eagle["blocks"], 128, 16, 5, 5) < 262_144
    fp8 = kc.window_capacity(kc.BEAM_501B_TP8, kc.MemoryFigures(f), 128, torch.float8_e4m3fn, drafter_layers=1)
    assert kc.longest_context(fp8["blocks"], 128, 16, 5, 5) >= 262_144
    full_eagle = kc.capacity(kc.BEAM_501B_TP8, kc.MemoryFigures(f), 128, torch.bfloat16, drafter_layers=1)
    bf16 = kc.capacity(kc.BEAM_501B_TP8, kc.MemoryFigures(f), 128, torch.bfloat16)
    assert bf16["blocks"] * 52 // 53 - 1 <= full_eagle["blocks"] <= bf16["blocks"] * 52 // 53 + 1


def test_the_dflash2_drafters_bytes_a_card():
    d = DFlash2Sizes()
    # The context window: 5 x 4096 x 8 x 128 x 2 (K, V) x 2 bytes on the node; one KV head a card.
    assert kc.dflash2_context_bytes(d) == 5 * 4096 * 8 * 128 * 2 * 2 == 83_886_080
    assert kc.dflash2_context_bytes(d, 8) == 83_886_080 // 8
    split = 5 * (5120 * 56 * 128 + 40 * 128 * 5120 + 3 * 5120 * 17408)
    replicated = (5 * (2 * (2 * 2 * 5120 + 4 * 320 * 5120) + 2 * 128 + 2 * 5120)  # convs, norms a layer
                  + 5 * 5120 * 5120 + 2 * 5120 + 2 * 151936 * 256 + 256 * 5120)  # fc, norms, selector
    assert kc.dflash2_params_per_card(d, 8) == {"split by TP (q/k/v/o, SwiGLU)": split // 8,
                                                "replicated (fc, conv projections, selector, norms)": replicated}
    # The replicated part is more than the split one: a card holds about half the drafter, not an eighth.
    assert round(sum(kc.dflash2_params_per_card(d, 8).values()) * 2 / 1e6, 1) == 964.8


def test_the_dflash2_count_is_the_models_own():
    """At TP 1 the count is the project's drafter built at the card's sizes (without the shared
    embedding): the card's 1.93B."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from beam_hpu.cardcheck.premises import FULL_DRAFTER
    from beam_hpu.model.dflash2 import DFlash2BeamModel
    from tests.support.dflash2_served import one_rank

    one_rank()
    with set_current_vllm_config(VllmConfig()), torch.device("meta"):
        model = DFlash2BeamModel(FULL_DRAFTER.per_card_config(1))
    count = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed_tokens"))
    assert count == sum(kc.dflash2_params_per_card(DFlash2Sizes(), 1).values())
    assert round(count / 1e9, 2) == 1.93


def test_the_dflash2_memory_lines_cost_the_pool_what_the_worker_split_gives(capsys):
    f = kc.free_from_graph_reserve(kc.RECIPE_GRAPH_RESERVE_GIB, kc.MemoryFigures(0.0))
    lines = kc.drafter_memory_lines(free_bytes=f)
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in lines if line.startswith("| ")}
    base = kc.capacity(kc.BEAM_501B_TP8, kc.MemoryFigures(f), 128, torch.bfloat16)["tokens"]
    d = DFlash2Sizes()
    both = sum(kc.dflash2_params_per_card(d, 8).values()) * 2 + 16 * kc.dflash2_context_bytes(d, 8)
    after = kc.capacity(kc.BEAM_501B_TP8, kc.MemoryFigures(f - both), 128, torch.bfloat16)["tokens"]
    assert rows["weights + context windows"][3] == f"{after:,}"
    assert rows["weights + context windows"][4].startswith(f"{base - after:,} tokens")
    # The worker keeps 0.9 x 0.6 of F for KV: the pool loses that share of the bytes, in whole blocks.
    assert abs((base - after) / 128 - both * 0.9 * 0.6 / (52 * 2 * 128 * 128 * 2)) <= 1
    assert kc.main([]) == 0
    out = capsys.readouterr().out
    assert "\n".join(lines) in out and "a model" in lines[0] and "83.9 MB on the node" in out
