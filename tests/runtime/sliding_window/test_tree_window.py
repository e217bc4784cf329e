"""The port's sliding-window units (beam-exact-window) on the vllm-gaudi tree named by
GAUDI_FIXES_ROOT, on CPU, with and without the port ("v0.30.0 only": the image without it).

The patched statements run from the file itself (tests/support/gaudi/source.py), with the
functions they call from beam_hpu; nothing imports vllm_gaudi. What is checked is the keys a
decode or prefill query attends.
"""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from tests.support.gaudi.sliding_window import prefill_attended
from tests.support.gaudi.source import PROCESSOR_CLS, RUNNER_CLS, block_mapping, load, method_body_if, namespace_replace, run_block
from tests.support.gaudi.tree import port_tree_fixture

pytestmark = pytest.mark.gaudi_tree
tree = port_tree_fixture()


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
        self.set_mapping = block_mapping(tree.runner)
        # The processor's state _set_block_mapping reads: its model type and window
        self.processor = SimpleNamespace(block_size=block_size, sliding_window=window, vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type))))

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
        bias = self.set_mapping(self.processor, metadata, len(positions) + 1, "cpu",
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


# Beam's geometry (512, 128) and smaller ones; a window no longer than the block (the tiny Beam's
# 32 under the backend's 128-token blocks) can lie inside the query's own block.
@pytest.mark.parametrize("block_size,window", [(4, 8), (4, 6), (8, 16), (128, 512), (8, 5), (8, 8), (128, 32)])
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
    assert ("if is_beam_model_type(model_type):" in tree.runner.read_text()) is tree.port


def test_other_models_keep_their_decode_window(tree):
    # gemma3 keeps the stock block-granular window with or without the port (the port gates on beam).
    positions = [5, 9, 14, 22]
    got = Decode(tree, "gemma3", 8, 4).attended(positions)
    assert got == [set(range(max(0, (p // 4 + 1 - 2) * 4), p + 1)) for p in positions]


# ---------------------------------------------------------------- prefill with context

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
                    custom_tuple_replace=namespace_replace)
    processor = SimpleNamespace(
        prefill_use_fusedsdpa=True, use_window_sdpa=False, slice_thld=8192, slice_size=1024, block_size=4,
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="gemma3"))))
    metadata = SimpleNamespace(is_prompt=True, block_list=torch.zeros(8, dtype=torch.int32), window_block_list=None,
                               block_size=4, context_lens_tensor=torch.tensor([5, 9]),
                               seq_lens_tensor=torch.tensor([3, 2]))
    with pytest.raises(RuntimeError):
        set_bias(processor, metadata, 2, 3, 8, "cpu", torch.bfloat16)
