"""The beam-1-0 port's runner patches (beam_hpu/runtime/<room>/beam-*.toml, profile port-beam-1-0) against the
vllm-gaudi tree named by GAUDI_FIXES_ROOT, on CPU.

Each test copies the tree, applies the stand-in port profile's vllm-gaudi fixes (the v0.30.0
ones, then the port's) or only the v0.30.0 ones ("stock" here means: the image without the
port), and runs the patched statements taken from the file itself (gaudi_source.py), with the
functions they call from beam_hpu. Nothing imports vllm_gaudi. What is checked is the
behaviour: the keys a decode or prefill query attends, the logits the grammar mask leaves.
"""
from __future__ import annotations

import ast
import itertools
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fix_trees import tree_digest
from gaudi_source import RUNNER, load, method_body_if, run_block
from test_fixes_gaudi import copy_tree, pytestmark  # noqa: F401  (skip without GAUDI_FIXES_ROOT)
from test_fixes_gaudi_units import HostTorch

from fixes.engine import EXIT_OK, run
from fixes.profile import load_profile

PORT_PROFILE = os.environ.get("GAUDI_PORT_PROFILE", "port-beam-1-0-public-main")
PORT_UNITS = ["beam-exact-window", "beam-grammar-device-mask", "beam-fsdpa-tiles", "beam-grammar-verify",
              "beam-eagle-draft-end", "beam-sampled-verify", "beam-exact-rounding", "beam-moe-gather",
              "beam-window-kv-cache", "beam-window-kv-steps", "beam-window-kv-metadata"]
RUNNER_CLS = "HPUModelRunner"
PROCESSOR_CLS = "HPUAttentionMetadataProcessor"


def gaudi_units(profile) -> list[str]:
    return [u.name for u in profile.fixes if u.package == "vllm_gaudi" and u.edits]


def apply(root, checkouts, only=None, check=False):
    profile = load_profile(PORT_PROFILE)
    return run(profile, roots={"vllm_gaudi": str(root)}, checkouts=checkouts,
               only=only or gaudi_units(profile), check=check)


@pytest.fixture(params=["v0.30.0 only", "port"])
def tree(request, tmp_path):
    root, checkouts = copy_tree(tmp_path / "site")
    profile = load_profile(PORT_PROFILE)
    only = gaudi_units(profile)
    if request.param != "port":
        only = [n for n in only if n not in PORT_UNITS]
    report = apply(root, checkouts, only=only)
    assert report.exit_code == EXIT_OK, report.lines
    return SimpleNamespace(root=root, port=request.param == "port", runner=root / RUNNER)


# ---------------------------------------------------------------- the profile

def test_port_profile_applies_once_parses_and_checks(tmp_path):
    root, checkouts = copy_tree(tmp_path / "site")
    first = apply(root, checkouts)
    assert first.exit_code == EXIT_OK, first.lines
    assert set(first.states.values()) == {"applied"}, first.lines
    assert list(first.states)[-len(PORT_UNITS):] == PORT_UNITS  # after every v0.30.0 fix
    ast.parse((root / RUNNER).read_text())
    before = tree_digest(root)
    second = apply(root, checkouts)
    assert set(second.states.values()) == {"already applied"}, second.lines
    assert tree_digest(root) == before
    assert apply(root, checkouts, check=True).exit_code == EXIT_OK
    # Both stamps are fresh: the v0.30.0 profile's own --check passes on the port's tree.
    base = load_profile(PORT_PROFILE).base
    assert run(base, roots={"vllm_gaudi": str(root)}, checkouts=checkouts,
               only=[n for n in gaudi_units(base)], check=True).exit_code == EXIT_OK


def test_port_patches_refuse_a_tree_without_the_v030_fixes(tmp_path):
    # Only the port's units on a stock tree: the decode edit anchors on swa-decode-window's text.
    root, checkouts = copy_tree(tmp_path / "site")
    before = tree_digest(root)
    report = apply(root, checkouts, only=PORT_UNITS)
    assert report.exit_code != EXIT_OK
    assert report.states["beam-exact-window"] == "refused", report.lines
    assert tree_digest(root) == before


def test_v030_profile_still_finds_its_fixes_after_the_port(tmp_path):
    """The recipe's launch runs `apply_all.py --profile v0.30.0` on the port image: the port's
    edits must leave every v0.30.0 replacement intact (found "already applied")."""
    root, checkouts = copy_tree(tmp_path / "site")
    assert apply(root, checkouts).exit_code == EXIT_OK
    base = load_profile(PORT_PROFILE).base
    again = run(base, roots={"vllm_gaudi": str(root)}, checkouts=checkouts, only=gaudi_units(base))
    assert again.exit_code == EXIT_OK and set(again.states.values()) == {"already applied"}, again.lines


# ---------------------------------------------------------------- decode window

class Decode:
    """The patched `if self.interleaved_sliding_window:` block of _create_decode_input_data, the
    window-start marks after it, and the processor's _set_block_mapping for the window blocks,
    taken from the file once."""

    def __init__(self, tree, model_type, window, block_size):
        self.tree, self.window, self.block_size = tree, window, block_size
        paged = load(tree.runner, "get_habana_paged_attn_buffers", RUNNER_CLS, torch=torch, itertools=itertools,
                     flatten=lambda x: list(itertools.chain(*x)),
                     pad_list=lambda lst, n, gen: lst + list(itertools.islice(gen, n - len(lst))))
        self.runner = SimpleNamespace(
            interleaved_sliding_window=True, sliding_window=window, attn_block_size=block_size,
            use_contiguous_pa=False, _PAD_BLOCK_ID=0, model_config=SimpleNamespace(dtype=torch.bfloat16),
            bucketing_manager=SimpleNamespace(find_decode_bucket=lambda bs, blocks: (bs, 1, blocks + 3)),
            get_dp_padding=lambda n: 0, _get_model_type=lambda: model_type)
        self.runner.get_habana_paged_attn_buffers = paged.__get__(self.runner)
        self.block = method_body_if(tree.runner, "_create_decode_input_data", RUNNER_CLS,
                                    "self.interleaved_sliding_window")
        # swa-decode-window marks the window starts later, before the usage goes to the device
        self.mark = method_body_if(tree.runner, "_create_decode_input_data", RUNNER_CLS,
                                   "self.interleaved_sliding_window and window_starts is not None")
        self.helpers = dict(exact_decode_window=load(tree.runner, "exact_decode_window"),
                            mark_window_starts=load(tree.runner, "mark_window_starts"),
                            EXACT_DECODE_WINDOW_MODELS=("gpt_oss", ))
        self.set_mapping = load(tree.runner, "_set_block_mapping", PROCESSOR_CLS, torch=torch, math=math,
                                is_fake_hpu=lambda: True,  # its CPU branch (one_hot of padding rows)
                                custom_tuple_replace=lambda m, _name, **kw: SimpleNamespace(**{**vars(m), **kw}))

    def attended(self, positions):
        """The set of positions each sequence's decode query attends in a sliding layer."""
        bs = self.block_size
        tables = [list(range(1000 * (b + 1), 1000 * (b + 1) + p // bs + 1)) for b, p in enumerate(positions)]
        slots = torch.tensor([[t[-1] * bs + p % bs] for t, p in zip(tables, positions)])
        names = run_block(self.block, self.tree.runner, self=self.runner, block_tables_list=tables,
                          slot_mapping=slots, padded_batch_size=len(positions) + 1, num_tokens=1,
                          decode_block_size=bs, **self.helpers)
        names = run_block(self.mark, self.tree.runner, **names)
        metadata = SimpleNamespace(window_block_usage=names["window_block_usage"],
                                   window_block_groups=names["window_block_groups"], block_size=bs)
        bias = self.set_mapping(SimpleNamespace(block_size=bs), metadata, len(positions) + 1, "cpu",
                                torch.bfloat16, is_window_block=True).window_attn_bias
        where = {bid: (b, col) for b, t in enumerate(tables) for col, bid in enumerate(t)}
        seen = [set() for _ in positions]
        for row, bid in enumerate(names["window_block_list"].tolist()):
            group = int(names["window_block_groups"][row])
            if not 0 <= group < len(positions):  # padding (-1, or the batch size on CPU)
                continue
            b, col = where[bid]
            assert b == group
            seen[b] |= {col * bs + s for s in range(bs) if bias[row, s] == 0}
        return seen


def edge_positions(window, block_size):
    """Every position for small geometries; near block and window edges for Beam's."""
    if block_size < 16:
        return list(range(0, window + 3 * block_size))
    edges = [0, block_size, window, window + block_size, 20 * block_size]
    return sorted({max(0, e + d) for e in edges for d in range(-3, 4)})


@pytest.mark.parametrize("block_size,window", [(4, 8), (4, 6), (8, 16), (128, 512)])
def test_beam_decode_window_is_exact(tree, block_size, window):
    decode = Decode(tree, "beam", window, block_size)
    positions = edge_positions(window, block_size)
    wrong = 0
    for start in range(0, len(positions), 4):  # batches of four sequences
        batch = positions[start:start + 4]
        got = decode.attended(batch)
        want = [set(range(max(0, p - window + 1), p + 1)) for p in batch]
        if tree.port:
            assert got == want, batch
        wrong += got != want
    if not tree.port:
        assert wrong > 0  # without the port, beam gets vllm-gaudi's block-granular window
    assert ('if model_type == "beam":' in tree.runner.read_text()) is tree.port


def test_other_models_keep_their_decode_window(tree):
    # gemma3 keeps the stock block-granular window with or without the port (the port gates on beam).
    positions = [5, 9, 14, 22]
    got = Decode(tree, "gemma3", 8, 4).attended(positions)
    assert got == [set(range(max(0, (p // 4 + 1 - 2) * 4), p + 1)) for p in positions]


# ---------------------------------------------------------------- prefill with context

def prefill_attended(tree, ctx_lens, query_lens, window, block_size, seq_len, context_blocks=None):
    """Run the patched _form_prefill_batch window statements and _set_attn_bias_for_sliding_window
    for a batch with cached context: per sequence, per real query row, the positions attended.
    `context_blocks` (default: distinct ids) may hold a window-sized cache's null block in the
    columns the window has left."""
    runner = SimpleNamespace(interleaved_sliding_window=True, sliding_window=window, attn_block_size=block_size,
                             _get_model_type=lambda: "beam")
    if context_blocks is None:
        context_blocks = [list(range(100 * (b + 1), 100 * (b + 1) + math.ceil(c / block_size)))
                          for b, c in enumerate(ctx_lens)]
    names = {"self": runner, "context_blocks": context_blocks, "context_lens": list(ctx_lens)}
    trim = method_body_if(tree.runner, "_form_prefill_batch", RUNNER_CLS,
                          "self.interleaved_sliding_window and self._get_model_type() == 'beam'")
    names = run_block(trim, tree.runner, **names)
    gate = method_body_if(tree.runner, "_form_prefill_batch", RUNNER_CLS,
                          "self.interleaved_sliding_window and self._get_model_type() in ('gemma4', 'beam') "
                          "and (target_blocks > 0)")
    align = load(tree.root / "vllm_gaudi/extension/utils.py", "align_and_pad", itertools=itertools,
                 pad_list=load(tree.root / "vllm_gaudi/extension/utils.py", "pad_list", itertools=itertools))
    names = run_block(gate, tree.runner, **names, target_blocks=1, target_bs=len(ctx_lens), align_and_pad=align,
                      itertools=itertools, torch=torch,
                      async_h2d_copy=lambda x, dtype: torch.tensor(x, dtype=dtype))
    window_list = names["window_context_blocks_t"]
    processor = SimpleNamespace(
        prefill_use_fusedsdpa=True, use_window_sdpa=False, slice_thld=8192, slice_size=1024, block_size=block_size,
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="beam"))))
    set_bias = load(tree.runner, "_set_attn_bias_for_sliding_window", PROCESSOR_CLS, torch=torch,
                    custom_tuple_replace=lambda m, _name, **kw: SimpleNamespace(**{**vars(m), **kw}))
    metadata = SimpleNamespace(is_prompt=True, block_list=torch.zeros(len(ctx_lens) * 40, dtype=torch.int32),
                               window_block_list=window_list, block_size=block_size,
                               context_lens_tensor=torch.tensor(ctx_lens, dtype=torch.int32),
                               seq_lens_tensor=torch.tensor(query_lens, dtype=torch.int32))
    bias = set_bias(processor, metadata, len(ctx_lens), seq_len, window, "cpu", torch.bfloat16).window_attn_bias
    per_seq = window_list.view(len(ctx_lens), -1)
    out = []
    for b, (ctx, q) in enumerate(zip(ctx_lens, query_lens)):
        col_of = {bid: col for col, bid in enumerate(context_blocks[b]) if bid != 0}  # 0: a freed column
        key_pos = [col_of[bid] * block_size + s if bid in col_of else None
                   for bid in per_seq[b].tolist() for s in range(block_size)] + [ctx + i for i in range(seq_len)]
        out.append([{key_pos[k] for k in range(len(key_pos)) if bias[b, 0, i, k] == 0} for i in range(q)])
    return out


@pytest.mark.parametrize("block_size,window", [(4, 8), (4, 6), (128, 512)])
def test_beam_prefill_with_context_is_exact_for_a_batch(tree, block_size, window):
    if not tree.port:  # without the port, beam's sliding layers see the whole context (no trim)
        assert "prefill_window_context" not in tree.runner.read_text()
        return
    cases = [([0 + 1, window - 1, window, window + 1], [3, 2, 5, 1]),
             ([7 * block_size - 1, 7 * block_size, 7 * block_size + 1, 3 * window + 2], [5, 4, 1, 3])]
    for ctx_lens, query_lens in cases:
        seq_len = max(query_lens) + 1
        got = prefill_attended(tree, ctx_lens, query_lens, window, block_size, seq_len)
        for b, (ctx, q) in enumerate(zip(ctx_lens, query_lens)):
            for i in range(q):
                pos = ctx + i
                assert got[b][i] == set(range(max(0, pos - window + 1), pos + 1)), (ctx, i)


def test_stock_prefill_window_mask_holds_for_one_sequence_only(tree):
    """Why the port builds the prefill bias itself: vllm-gaudi's context mask for a batch of two."""
    set_bias = load(tree.runner, "_set_attn_bias_for_sliding_window", PROCESSOR_CLS, torch=torch,
                    custom_tuple_replace=lambda m, _name, **kw: SimpleNamespace(**{**vars(m), **kw}))
    processor = SimpleNamespace(
        prefill_use_fusedsdpa=True, use_window_sdpa=False, slice_thld=8192, slice_size=1024, block_size=4,
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="gemma3"))))
    metadata = SimpleNamespace(is_prompt=True, block_list=torch.zeros(8, dtype=torch.int32), window_block_list=None,
                               block_size=4, context_lens_tensor=torch.tensor([5, 9]),
                               seq_lens_tensor=torch.tensor([3, 2]))
    with pytest.raises(RuntimeError):
        set_bias(processor, metadata, 2, 3, 8, "cpu", torch.bfloat16)


# ---------------------------------------------------------------- grammar mask on the device

def masked_logits(tree, monkeypatch, switch, rows, grammar, model_type="beam"):
    import xgrammar

    calls = []

    def cpu_kernel(logits, bitmask, indices=None):
        calls.append("cpu")
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=indices)

    monkeypatch.setenv("BEAM_GRAMMAR_DEVICE_MASK", switch)
    apply_mask = load(tree.runner, "apply_grammar_bitmask", RUNNER_CLS, np=np, torch=HostTorch(),
                      xgr_cpu=SimpleNamespace(apply_token_bitmask_inplace_cpu=cpu_kernel))
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(rows)}),
                             device="cpu", _get_model_type=lambda: model_type)
    vocab = 70
    words = math.ceil(vocab / 32)
    bitmask = np.zeros((len(grammar), words), dtype=np.int32)
    for i, allowed in enumerate(grammar.values()):
        for tok in allowed:
            bitmask[i, tok // 32] |= np.int32(np.uint32(1 << (tok % 32)).view(np.int32))
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    grammar_output = SimpleNamespace(grammar_bitmask=bitmask, structured_output_request_ids=list(grammar))
    apply_mask(runner, SimpleNamespace(scheduled_spec_decode_tokens={}), grammar_output, logits, list(rows))
    return logits, calls


@pytest.mark.parametrize("grammar", [{"b": [0, 31, 32, 63, 69]}, {"a": [5], "b": [1, 2], "c": [64, 31]}])
def test_grammar_mask_on_the_device_matches_the_cpu_round_trip(tree, monkeypatch, grammar):
    rows = ["a", "b", "c"]
    device, device_calls = masked_logits(tree, monkeypatch, "1", rows, grammar)
    host, host_calls = masked_logits(tree, monkeypatch, "0", rows, grammar)
    assert host_calls == ["cpu"]
    assert device_calls == ([] if tree.port else ["cpu"])  # the port never round-trips with the switch on
    assert torch.equal(device, host)
    for r, req in enumerate(rows):
        allowed = set(grammar.get(req, range(70)))
        assert {t for t in range(70) if device[r, t] != float("-inf")} == allowed


def test_grammar_mask_stays_stock_for_another_model(tree, monkeypatch):
    """The plugin's image may serve other models: with the switch on, a llama's mask still takes
    vllm-gaudi's CPU round trip (the port acts for model type beam only)."""
    rows, grammar = ["a", "b", "c"], {"a": [5], "b": [1, 2], "c": [64, 31]}
    other, other_calls = masked_logits(tree, monkeypatch, "1", rows, grammar, model_type="llama")
    beam, _ = masked_logits(tree, monkeypatch, "1", rows, grammar)
    assert other_calls == ["cpu"]
    assert torch.equal(other, beam)
