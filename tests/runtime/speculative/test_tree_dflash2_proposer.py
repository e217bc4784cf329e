"""The port unit beam-dflash2-proposer on the vllm-gaudi tree (GAUDI_FIXES_ROOT; skipped without it).

What runs is the tree's own code: HPUModelRunner.__init__'s drafter choice, load_model's choice
of auxiliary layers, and whole steps of _prepare_inputs (prefill batches padded by the tree,
verify steps in its padded B x (k + 1) layout with its SpecDecodeMetadata) handed to the tree's
propose_draft_token_ids, which the unit routes to HpuDFlash2Proposer with the committed tiny
drafter. Stand-ins only for what has no CPU form or no part in drafting: the target model (the
auxiliary hidden states are a fixed table per request and position, garbage at rejected rows),
vllm-gaudi's HpuEagleProposer module (a recording class; importing vllm_gaudi needs a card) and
NgramProposer / RejectionSampler (recording classes).
"""
from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from beam_hpu.model.dflash2 import DFlash2Context, target_aux_layer_ids
from beam_hpu.runtime.speculative import dflash2_context
from beam_hpu.runtime.speculative.hpu_dflash2_proposer import HpuDFlash2Proposer
from beam_hpu.tiny.dflash2_drafter import DFLASH2_DIR
from tests.support.dflash2_served import tiny_dflash2
from tests.support.gaudi.source import RUNNER_CLS, method_body_if, run_block
from tests.support.gaudi.tree import port_tree, port_tree_fixture
from tests.support.gaudi.window_kv_runner import make_runner, set_batch
from tests.support.window_kv.configs import full_only_config

pytestmark = pytest.mark.gaudi_tree
tree = port_tree_fixture(scope="module")  # the tests only read the tree

K = 3
BS, NUM_BLOCKS, WIDTH = 4, 64, 16
DRAFT_ARCH = "DFlash2BeamDraftModel"


@pytest.fixture(autouse=True)
def vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def drafter_config():
    return SimpleNamespace(**json.loads((DFLASH2_DIR / "config.json").read_text()))


def serving_config(model_type="beam", method="dflash", arch=DRAFT_ARCH, max_model_len=4096):
    draft = SimpleNamespace(hf_config=drafter_config(), architectures=[arch])
    spec = SimpleNamespace(method=method, num_speculative_tokens=K, draft_model_config=draft,
                           use_eagle=lambda: method in ("eagle", "eagle3", "dflash", "mtp"))
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type),
                                                        max_model_len=max_model_len),
                           speculative_config=spec, scheduler_config=SimpleNamespace(max_num_seqs=4))


class Recorded:
    def __init__(self, *args):
        self.args = args


@pytest.fixture
def hpu_eagle_module(monkeypatch):
    """vllm-gaudi's hpu_eagle module as the runner imports it, holding a recording class."""
    for name in ("vllm_gaudi", "vllm_gaudi.v1", "vllm_gaudi.v1.spec_decode"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    module = types.ModuleType("vllm_gaudi.v1.spec_decode.hpu_eagle")
    module.HpuEagleProposer = type("HpuEagleProposer", (Recorded, ), {})
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def choose_drafter(tree, config):
    """The tree's `if self.speculative_config:` block of HPUModelRunner.__init__."""
    runner = SimpleNamespace(speculative_config=config.speculative_config, vllm_config=config, device="cpu",
                             use_aux_hidden_state_outputs=False, sampler=None)
    block = method_body_if(tree.runner, "__init__", RUNNER_CLS, "self.speculative_config")
    run_block(block, tree.runner, self=runner, NgramProposer=type("NgramProposer", (Recorded, ), {}),
              RejectionSampler=Recorded)
    return runner


def test_a_beam_target_with_the_dflash2_drafter_gets_the_block_proposer(tree, hpu_eagle_module):
    runner = choose_drafter(tree, serving_config())
    if not tree.port:  # vllm-gaudi: dflash counts as EAGLE, so EAGLE's one-token loop would draft it
        assert type(runner.drafter).__name__ == "HpuEagleProposer" and not runner.use_aux_hidden_state_outputs
        return
    assert isinstance(runner.drafter, HpuDFlash2Proposer) and runner.use_aux_hidden_state_outputs
    assert runner.drafter.target_aux_layer_ids == tuple(target_aux_layer_ids(drafter_config()))
    assert not hasattr(runner.drafter, "model")  # vllm-gaudi would wrap a `model` in its HpuModelAdapter


@pytest.mark.parametrize("config", [
    dict(model_type="qwen3"), dict(arch="DFlashDraftModel"), dict(method="ngram"), dict(method="eagle3")])
def test_other_targets_and_drafters_keep_vllm_gaudis_proposers(tree, hpu_eagle_module, config):
    runner = choose_drafter(tree, serving_config(**config))
    expected = "NgramProposer" if config.get("method") == "ngram" else "HpuEagleProposer"
    assert type(runner.drafter).__name__ == expected


@pytest.mark.parametrize("drafter", ["dflash2", "eagle3"])
def test_the_target_returns_the_layers_the_drafter_reads(tree, drafter):
    """load_model's auxiliary layers: the DFlash2 config's target_layer_ids + 1 (stock: the model's
    EAGLE3 defaults, states the drafter was not trained on)."""
    chosen = []
    target = SimpleNamespace(set_aux_hidden_state_layers=chosen.append,
                             get_eagle3_default_aux_hidden_state_layers=lambda: (2, 26, 49))
    runner = SimpleNamespace(model=SimpleNamespace(model=target), use_aux_hidden_state_outputs=True,
                             drafter=SimpleNamespace() if drafter == "eagle3" else
                             SimpleNamespace(target_aux_layer_ids=(5, 17, 29, 41, 47)))
    block = method_body_if(tree.runner, "load_model", RUNNER_CLS, "self.use_aux_hidden_state_outputs")
    run_block(block, tree.runner, self=runner, supports_eagle3=lambda m: True)
    want = (5, 17, 29, 41, 47) if tree.port and drafter == "dflash2" else (2, 26, 49)
    assert chosen == [want]


# ------------------------------------------------------------- whole steps

class Target:
    """The target's auxiliary states: a fixed random table per request and position (what a
    deterministic model would return there), garbage where a verify row holds a rejected draft."""

    def __init__(self, width, seed=0):
        self.g, self.width, self.table = torch.Generator().manual_seed(seed), width, {}

    def at(self, rid, pos):
        if (rid, pos) not in self.table:
            self.table[rid, pos] = torch.randn(self.width, generator=self.g)
        return self.table[rid, pos]

    def rows(self, rids_and_positions, accepted):
        """[rows, n * H]: each row's state, or 1e4 where accepted is False or there is no request."""
        out = torch.full((len(rids_and_positions), self.width), 1e4)
        for i, ((rid, pos), ok) in enumerate(zip(rids_and_positions, accepted)):
            if rid is not None and ok:
                out[i] = self.at(rid, pos)
        return out


class Seq:
    def __init__(self, rid, prompt):
        self.rid, self.tokens, self.prompt_len, self.computed, self.drafts = rid, list(prompt), len(prompt), 0, []


def run_step(runner, seqs, target, accept, n_states):
    """One scheduled step: prefills (whole prompts) and decodes (their drafts verified, accepting
    accept[rid]); returns the drafts the tree's propose_draft_token_ids hands back, by request."""
    decodes = [s for s in seqs if s.computed >= s.prompt_len]
    prefills = [s for s in seqs if s.computed < s.prompt_len]
    order = decodes + prefills
    views = [SimpleNamespace(rid=s.rid, tokens=s.tokens + s.drafts, computed=s.computed, prompt_len=s.prompt_len)
             for s in order]
    tables = [[list(range(8 * b + 1, 8 * b + 9)) for b in range(len(order))]]
    set_batch(runner, views, tables, WIDTH)
    runner.requests = {s.rid: s for s in order}
    scheduled = {s.rid: (1 + len(s.drafts) if s in decodes else s.prompt_len - s.computed) for s in order}
    sched = SimpleNamespace(total_num_scheduled_tokens=sum(scheduled.values()), num_scheduled_tokens=scheduled,
                            scheduled_spec_decode_tokens={s.rid: s.drafts for s in decodes if s.drafts})
    (prefill, _), (decode, _) = runner._prepare_inputs(sched, len(prefills), len(decodes))
    # what the verify / prefill samples: accepted drafts + a bonus token per request
    sampled = []
    for s in order:
        a = accept.get(s.rid, 0) if s in decodes else 0
        sampled.append(s.drafts[:a] + [100 + len(s.tokens)])
    aux, aux_prefills = None, []
    if decodes:
        pos = decode.position_ids.reshape(-1).tolist()
        meta = decode.spec_decode_metadata
        per = 1 if meta is None else len(pos) // len(meta.num_draft_tokens)
        owner = [(order[i // per].rid if i // per < len(decodes) else None, p) for i, p in enumerate(pos)]
        ok = [i // per < len(decodes) and i % per < len(sampled[i // per]) for i in range(len(pos))]
        aux = list(target.rows(owner, ok).view(-1, per, target.width).chunk(n_states, dim=-1))
    for rids, positions in zip(prefill.request_ids or [], prefill.position_ids or []):
        bs, T = positions.shape
        owner = [(rids[i // T] if i // T < len(rids) else None, p) for i, p in enumerate(positions.reshape(-1).tolist())]
        states = target.rows(owner, [p >= 0 for _, p in owner]).view(bs, T, target.width)
        aux_prefills.append(list(states.chunk(n_states, dim=-1)))
    drafts = runner.propose_draft_token_ids(sched, sampled, None, None, None, aux, None, None, None, None,
                                            aux_prefills, len(decodes), prefill if prefills else None,
                                            decode if decodes else None)
    for s, new in zip(order, sampled):
        s.computed = len(s.tokens) + len(new) - 1
        s.tokens += new
    out = dict(zip([s.rid for s in order], drafts.tolist()))
    for s in order:
        s.drafts = out[s.rid]
    return out


def reference(model, target, seqs):
    """Each request's block over every accepted row's state fed at once (the CPU path's context):
    (drafts by request, the block's hidden states [R, K + 1, H])."""
    contexts = []
    for s in seqs:
        pos = torch.arange(len(s.tokens) - 1)  # every token but the last (the bonus) is context
        k, v = model.context_kv(model.combine_hidden_states(torch.stack([target.at(s.rid, p) for p in pos.tolist()])),
                                pos)
        contexts.append(dflash2_context.extend(None, pos, k, v, model.config.sliding_window))
    keys, values, ctx_pos, valid = dflash2_context.batch(contexts)
    last = torch.tensor([c.last_position for c in contexts])
    ids, block_pos, in_range = dflash2_context.block_inputs(torch.tensor([s.tokens[-1] for s in seqs]), last, K + 1,
                                                            model.mask_token_id, model.config.max_position_embeddings)
    hidden = model(ids, block_pos, DFlash2Context(keys, values, ctx_pos, valid, in_range))
    return dict(zip([s.rid for s in seqs], model.draft_greedy(hidden, ids[:, 0])[0].tolist())), hidden


@pytest.fixture(scope="module")
def ported(tmp_path_factory):
    return port_tree(tmp_path_factory.mktemp("site"))


def test_the_trees_steps_draft_as_over_the_accepted_context(ported):
    """Two prompts prefilled in one batch; two verify steps (a accepts 1 then 3 drafts, b 3 then
    0) with a third prompt prefilled beside the second; then a plain decode step of all three
    (the scheduler dropped their drafts). Every request's drafts equal a block
    over its accepted rows fed at once: the tree's prefill padding (-1), its verify layout and
    its padded batch reach the proposer's mask and slots as they should; the block's hidden
    states match, not only its greedy drafts. (Stock vllm-gaudi has no DFlash2 drafting to step
    through: its choice of drafter is the first test's.)"""
    model = tiny_dflash2()
    n_states = len(model.config.dflash_config["target_layer_ids"])
    runner = make_runner(ported.runner, full_only_config(BS, NUM_BLOCKS), block_size=BS, window=4096,
                         num_kv_blocks=NUM_BLOCKS)
    config = serving_config()
    runner.vllm_config = config
    runner.speculative_config = config.speculative_config
    runner.drafter = HpuDFlash2Proposer(config, "cpu", runner)
    from vllm.config import get_current_vllm_config

    runner.drafter.vllm_config = get_current_vllm_config()  # what the step's forward context reads
    runner.drafter.attach(model)
    target = Target(model.model.fc.input_size)
    blocks = []  # the drafter's block outputs of a step: the decode batch's, then each prefill batch's
    model.register_forward_hook(lambda m, i, out: blocks.append(out))
    a, b, c = Seq("a", range(1, 10)), Seq("b", range(1, 6)), Seq("c", range(20, 27))
    with torch.no_grad():
        for seqs, accept, live in (([a, b], {}, [2]), ([a, b], {"a": 1, "b": 3}, [2]),
                                   ([a, b, c], {"a": 3, "b": 0}, [2, 1]), ([a, b, c], {}, [3])):
            if live == [3]:  # the scheduler dropped every draft: a plain decode step, no spec metadata
                for s_ in seqs:
                    s_.drafts = []
            blocks.clear()
            drafts = run_step(runner, seqs, target, accept, n_states)
            expected, hidden = reference(model, target, seqs)
            blocks.pop()  # the reference's own
            assert drafts == expected
            got = torch.cat([out[:n] for out, n in zip(blocks, live)])
            torch.testing.assert_close(got, hidden, rtol=1e-5, atol=1e-5)
    assert len(a.tokens) == 9 + 1 + 2 + 4 + 1 and len(b.tokens) == 5 + 1 + 4 + 1 + 1
