"""The eight vllm-gaudi fixes of the pack's order, stock vs patched, on CPU.

Each test copies the GAUDI_FIXES_ROOT tree, applies the profile's vllm-gaudi fixes to the copy
(or leaves it stock), and runs the function the fix changes, taken from the file itself
(tests/support/gaudi/source.py: public main does not import against vLLM 0.30.0, so nothing imports
vllm_gaudi). Where a fix changes one line inside a long method, the statement holding it is
run, or its place in the method is checked (said so in the test).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fixes.engine import EXIT_OK
from tests.support.gaudi.source import (PATCHES, RUNNER, RUNNER_CLS, HostTorch, calls_in_order, load, method_body_if,
                                        run_block)
from tests.support.gaudi.tree import apply_fixes, copy_tree

pytestmark = pytest.mark.gaudi_tree


@pytest.fixture(params=["stock", "patched"])
def tree(request, tmp_path):
    root, checkouts = copy_tree(tmp_path / "site")
    if request.param == "patched":
        assert apply_fixes(root, checkouts).exit_code == EXIT_OK
    return SimpleNamespace(root=root, patched=request.param == "patched", runner=root / RUNNER,
                           patches=root / PATCHES)


# ---------------------------------------------------------------- prompt-order

class Batch:
    """The persistent batch as far as the reorder sees it: ids and a swap that moves them."""

    def __init__(self, req_ids):
        self.req_ids = list(req_ids)

    @property
    def num_reqs(self):
        return len(self.req_ids)

    def swap_states(self, i, j):
        self.req_ids[i], self.req_ids[j] = self.req_ids[j], self.req_ids[i]


def test_prompt_order_runs_prompts_in_schedule_order(tree):
    sort = load(tree.runner, "prompts_in_schedule_order")
    calls = calls_in_order(tree.runner, "sample_tokens", RUNNER_CLS)
    if not tree.patched:
        assert sort is None and "prompts_in_schedule_order" not in calls
        return
    # Scheduled: running decode d0, then prompts a (writes the shared prefix), b and c (hit it).
    scheduled = {"d0": 1, "a": 300, "b": 44, "c": 12}
    batch = Batch(["d0", "c", "b", "a"])  # slots refilled out of order
    assert sort(batch, 1, scheduled) is True
    assert batch.req_ids == ["d0", "a", "b", "c"]
    assert sort(batch, 1, scheduled) is False  # already in order: the batch is not marked changed
    # It runs before the prompts/decodes split that every later step indexes by.
    assert calls.index("prompts_in_schedule_order") < calls.index("self._get_prompts_and_decodes")


# ---------------------------------------------------------------- so-row-owners

def fake_apply_bitmask(logits, bitmask, indices=None):
    """xgrammar's CPU kernel, by its contract: bit v of a row's mask clear -> token v is -inf."""
    rows = range(logits.shape[0]) if indices is None else [int(i) for i in indices]
    for row in rows:
        for v in range(logits.shape[1]):
            if not (int(bitmask[row, v // 32]) >> (v % 32)) & 1:
                logits[row, v] = -math.inf


def grammar_rows(tree, batch_order, rows, grammar):
    """Which tokens each logit row may take after apply_grammar_bitmask. `grammar` maps each
    grammar request to the one token its grammar allows."""
    apply_mask = load(tree.runner, "apply_grammar_bitmask", RUNNER_CLS, np=np, torch=HostTorch(),
                      xgr_cpu=SimpleNamespace(apply_token_bitmask_inplace_cpu=fake_apply_bitmask))
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(batch_order)}),
                             device="cpu")
    bitmask = np.array([[1 << tok] for tok in grammar.values()], dtype=np.int32)
    grammar_output = SimpleNamespace(grammar_bitmask=bitmask, structured_output_request_ids=list(grammar))
    scheduler_output = SimpleNamespace(scheduled_spec_decode_tokens={})
    logits = torch.zeros(len(rows), 4)
    args = (runner, scheduler_output, grammar_output, logits) + ((rows, ) if tree.patched else ())
    apply_mask(*args)
    return [[v for v in range(4) if logits[r, v] == 0] for r in range(len(rows))]


def test_so_row_owners_masks_land_on_the_owners_rows(tree):
    # Batch: decode d0, a prompt chunk p1 that samples nothing (no row), prompts p2 and p3.
    # Rows: d0, p2, p3. Only p2 is a grammar request (token 2).
    allowed = grammar_rows(tree, ["d0", "p1", "p2", "p3"], ["d0", "p2", "p3"], {"p2": 2})
    if tree.patched:
        assert allowed == [[0, 1, 2, 3], [2], [0, 1, 2, 3]]
    else:  # p2's mask lands on p3's row (its batch index); p2 samples freely
        assert allowed == [[0, 1, 2, 3], [0, 1, 2, 3], [2]]


def test_so_row_owners_grammar_request_past_the_last_row(tree):
    # A grammar request whose batch index is past the last row: stock raises, patched masks it.
    def run():
        return grammar_rows(tree, ["d0", "p1", "p2"], ["d0", "p2"], {"d0": 1, "p2": 2})

    if tree.patched:
        assert run() == [[1], [2]]
    else:
        with pytest.raises(IndexError):
            run()


def test_so_row_owners_feed_sampling_and_logprobs(tree):
    """Structural: the structured-output branch passes the owners to _run_sampling (as its
    logits_requests, which drops ids without a row) and names the logprobs rows with them."""
    text = tree.runner.read_text()
    owners = "row_owners = list(decode_sampled_requests) + list(prefill_sampled_requests)"
    assert (owners in text) is tree.patched
    assert ("row_owners)  # beam-hpu fix so-row-owners" in text) is tree.patched
    assert ("struct_logprobs_req_ids = row_owners" in text) is tree.patched


# ---------------------------------------------------------------- async-inputs

def test_async_inputs_a_re_added_decode_keeps_the_host_token(tree):
    """Run the real _prepare_input_ids and the decode path's async block: decode `a` ran last
    step (its token 7 is on the device), `b` was re-added (its token 5 is on the host only)."""
    prepare = load(tree.runner, "_prepare_input_ids", RUNNER_CLS, np=np, torch=torch, Optional=object)
    cumsum = load(tree.runner, "_get_cumsum_and_arange", RUNNER_CLS, np=np, Optional=object)
    batch = SimpleNamespace(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1},
                            prev_sampled_token_ids=torch.tensor([7, 3], dtype=torch.int32),
                            prev_req_id_to_index={"a": 0, "z": 1}, prev_sampled_token_ids_invalid_indices=set())
    runner = SimpleNamespace(input_batch=batch, device="cpu", arange_np=np.arange(64),
                             input_ids_hpu=torch.full((8, ), 99, dtype=torch.int32), use_async_scheduling=True)
    runner._prepare_input_ids = lambda *a, **k: prepare(runner, *a, **k)
    runner._get_cumsum_and_arange = lambda *a, **k: cumsum(runner, *a, **k)
    host_tokens = torch.tensor([[0], [5], [0], [0]], dtype=torch.int32)  # a: placeholder, b: 5
    block = method_body_if(tree.runner, "_create_decode_input_data", RUNNER_CLS,
                           "self.use_async_scheduling and scheduler_output is not None")
    names = run_block(block, tree.runner, self=runner, torch=torch, num_tokens=1, num_decodes=2,
                      token_ids_device=host_tokens.clone(), total_num_scheduled_tokens=2,
                      scheduler_output=SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 1}))
    tokens = names["token_ids_device"][:2].flatten().tolist()
    assert tokens == ([7, 5] if tree.patched else [7, 99])  # stock: b gets a stale device value


# ---------------------------------------------------------------- resumed-prefill-logits

class Contents:
    def __init__(self, **kw):
        self.__dict__.update({k: kw.get(k, []) for k in
                              ("req_ids", "token_ids", "context_lens", "prompt_lens", "blocks", "logits_positions")})


def test_resumed_prefill_samples_one_token(tree):
    extract = load(tree.runner, "_extract_prefill_batch_contents", RUNNER_CLS, BatchContents=Contents,
                   round_up=lambda x, m: -(-x // m) * m, merge_contents=None)
    # A request resumed after preemption: prompt of 4 tokens, 3 generated before, all recomputed.
    tokens = np.zeros((1, 16), dtype=np.int64)
    tokens[0, :7] = [11, 12, 13, 14, 21, 22, 23]
    batch = SimpleNamespace(req_ids=["r"], num_computed_tokens_cpu=np.array([0]), token_ids_cpu=tokens,
                            num_prompt_tokens=np.array([4]),
                            block_table=[SimpleNamespace(get_cpu_tensor=lambda: torch.tensor([[5, 6]]))])
    runner = SimpleNamespace(input_batch=batch, attn_block_size=4, use_async_scheduling=False,
                             use_structured_output=False, invalid_req_indices=[],
                             _get_attention_group_id_for_hybrid=lambda: 0, _resolve_block=lambda b: b,
                             _can_merge_prefill_contents=lambda lhs, rhs: False, get_dp_padding=lambda n: 0)
    contents, _ = extract(runner, 1, 0, np.array([7]))
    positions = [c.logits_positions for c in contents if c.req_ids]
    assert positions == ([[[6]]] if tree.patched else [[[3, 4, 5, 6]]])  # stock re-samples 21, 22, 23


# ---------------------------------------------------------------- gather-logprobs-int32

def test_gather_logprobs_concatenates_int32_ids(tree, monkeypatch):
    from vllm.v1.outputs import LogprobsTensors

    cat_dtypes = []
    real_cat = torch.cat

    def spy_cat(tensors, *args, **kwargs):
        cat_dtypes.append(tuple(t.dtype for t in tensors))
        return real_cat(tensors, *args, **kwargs)

    logprobs = torch.log_softmax(torch.randn(3, 70000), dim=-1)  # ids past 2**16
    ids = torch.tensor([69999, 65537, 5], dtype=torch.int64)
    gather = load(tree.patches, "_hpu_gather_logprobs", torch=torch)
    prompt_gather = load(tree.runner, "_gather_prompt_logprobs_hpu", RUNNER_CLS, torch=torch,
                         LogprobsTensors=LogprobsTensors)
    monkeypatch.setattr(torch, "cat", spy_cat)
    for out in (gather(logprobs, 4, ids), prompt_gather(None, logprobs, 4, ids)):
        assert out.logprob_token_ids.dtype == torch.int32
        assert out.logprob_token_ids[:, 0].tolist() == ids.tolist()
        assert out.logprob_token_ids[:, 1:].tolist() == torch.topk(logprobs, 4).indices.tolist()
    int_cats = [d for d in cat_dtypes if d[0] in (torch.int32, torch.int64)]
    assert len(int_cats) == 2
    expected = (torch.int32, torch.int32) if tree.patched else (torch.int64, torch.int64)
    assert all(d == expected for d in int_cats)


# ---------------------------------------------------------------- prompt-logprobs

def test_prompt_logprobs_rows_follow_the_token_layout(tree):
    rows_of = load(tree.runner, "prompt_logprobs_rows", torch=torch)
    if not tree.patched:
        assert rows_of is None
        # Stock keeps non_flattened_hidden_states[i]: with flattened hidden states that is a
        # single token's vector, so hs[:num_logits] slices the hidden dimension.
        assert "non_flattened_hidden_states[i]" in tree.runner.read_text()
        return
    hidden = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)  # bs 2, seq 5, H 3
    scheduled = {"a": 4, "b": 2}
    for layout in (hidden, hidden.view(10, 3)):  # as returned, and with flatten_input
        rows = rows_of(layout, 5, ["a", "b"], scheduled, False)
        assert torch.equal(rows["a"], hidden[0, :4]) and torch.equal(rows["b"], hidden[1, :2])
    merged = torch.arange(6 * 3, dtype=torch.float32).view(1, 6, 3)  # a's 4 tokens, then b's 2
    rows = rows_of(merged, 6, ["a", "b"], scheduled, True)
    assert torch.equal(rows["a"], merged[0, :4]) and torch.equal(rows["b"], merged[0, 4:6])
    assert "non_flattened_hidden_states[i]" not in tree.runner.read_text()


# ---------------------------------------------------------------- seeded-sampling

def test_seeded_sampling_uses_host_generators(tree):
    import vllm.v1.sample.ops.topk_topp_sampler as tts

    text = tree.runner.read_text()
    assert ('generator = torch.Generator(device="cpu")' in text) is tree.patched
    sample = load(tree.runner, "_random_sample_seeded_on_host", torch=torch, _topk_topp_sampler=tts,
                  _stock_random_sample=tts.random_sample)
    if not tree.patched:
        assert sample is None and "generator = torch.Generator(device=self.device)" in text
        return
    probs = torch.softmax(torch.randn(4, 50), dim=-1)

    def gens(seed):
        return {1: torch.Generator().manual_seed(seed), 3: torch.Generator().manual_seed(seed + 1)}

    # Same device: exactly the stock function (seeded rows reproducible).
    torch.manual_seed(0)
    stock = tts.random_sample(probs.clone(), gens(7))
    torch.manual_seed(0)
    assert torch.equal(sample(probs.clone(), gens(7)), stock)
    # Noise on another device ("meta" stands in for the HPU): seeded rows are drawn with the
    # host generators, which advance, and the result stays on the noise's device.
    host = gens(7)
    before = {i: g.get_state().clone() for i, g in host.items()}
    out = sample(probs.to("meta"), host)
    assert out.device.type == "meta" and out.shape == (4, )
    assert all(not torch.equal(g.get_state(), before[i]) for i, g in host.items())


# ---------------------------------------------------------------- swa-decode-window

def attended_positions(tree, window, block_size, position, exact):
    """Positions the decode query at `position` attends in a sliding-window layer."""
    table = list(range(100, 100 + position // block_size + 1))  # block ids
    slots = [[table[-1] * block_size + position % block_size]]
    if exact:
        tables, starts = load(tree.runner, "exact_decode_window")([table], slots, window, block_size)
    else:  # the stock selection, gpt_oss's +1 block
        tables, starts = [table[-(window // block_size + 1):]], None
    usage = [block_size] * (len(tables[0]) - 1) + [position % block_size + 1]
    usage = torch.tensor(usage, dtype=torch.bfloat16)
    if exact:
        load(tree.runner, "mark_window_starts")(usage, tables, starts)
    set_mapping = load(tree.runner, "_set_block_mapping", "HPUAttentionMetadataProcessor", torch=torch,
                       math=math, is_fake_hpu=lambda: False,
                       custom_tuple_replace=lambda m, _name, **kw: SimpleNamespace(**{**vars(m), **kw}))
    metadata = SimpleNamespace(window_block_usage=usage, window_block_groups=torch.zeros(len(usage), dtype=torch.long),
                               block_size=block_size)
    bias = set_mapping(SimpleNamespace(block_size=block_size), metadata, 1, "cpu", torch.bfloat16,
                       is_window_block=True).window_attn_bias
    first_block = len(table) - len(tables[0])
    return {(first_block + b) * block_size + s for b in range(len(usage)) for s in range(block_size) if bias[b, s] == 0}


@pytest.mark.parametrize("window", [8, 6])
def test_swa_decode_window_is_exact(tree, window):
    block_size = 4
    wrong = 0
    for position in range(0, 30):
        expected = set(range(max(0, position - window + 1), position + 1))
        if tree.patched:
            assert attended_positions(tree, window, block_size, position, exact=True) == expected, position
        wrong += attended_positions(tree, window, block_size, position, exact=False) != expected
    assert wrong > 0  # the stock block-granular window over-attends
    if tree.patched:
        calls = calls_in_order(tree.runner, "_create_decode_input_data", RUNNER_CLS)
        assert calls.index("exact_decode_window") < calls.index("mark_window_starts")
        assert "EXACT_DECODE_WINDOW_MODELS = (\"gpt_oss\", )" in tree.runner.read_text()
