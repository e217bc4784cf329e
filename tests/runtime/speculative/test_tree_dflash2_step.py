"""The Gaudi DFlash2 proposer's step (HpuDFlash2Proposer, its DFlash2Step) on the vllm-gaudi tree's
layers, on CPU, at k = 7: its drafts equal vLLM-CPU's DFlash2 proposer's (CpuDFlash2Proposer,
what serving on CPU runs) over the same accepted rows, on the ported 091bbadd tree and on the
release proxy with its port profile (GAUDI_FIXES_ROOT; skipped without a tree).

The committed tiny drafter is built in a fresh interpreter on the tree's layers (hpu_layers.install():
vLLM picks the tree's HpuPlatform, its register_ops() makes the drafter's RotaryEmbedding an
HPURotaryEmbedding and its RMSNorms HPURMSNorms, each dispatched to `forward_oot`; the Habana kernels
are tests/support/gaudi/habana_ops.py's stand-ins), and driven as vllm-gaudi's runner drives the
proposer; in a second fresh interpreter it is built on vLLM-CPU's layers and driven as vLLM's V1
runner drives CpuDFlash2Proposer. Three steps of two requests (tests/support/dflash2_steps.py): a
prefill, then verify steps rejecting drafts, so each block reads context kept from earlier steps;
one request at the top of max_model_len, its blocks clamped there. In bfloat16, the dtype vllm-gaudi
serves in, and float32.

Equality: the greedy drafts must be equal, every row of every block (clamped rows too), except
where vLLM-CPU's walk is within FLIP_BOUND of a tie (tests/support/dflash2_served.py: a near-tie
another host's bf16 roundings may break the other way; the request's later drafts then follow
another path and are not compared); none differs on this host. The
block's hidden states, which the drafts are walked from, are held to the rope test's bound
(tests/runtime/speculative/test_tree_dflash2_rope.py): what Habana's card tests accept for one
RMSNorm plus one RoPE against their fp32 references. Measured: float32 within 1.1e-5; bfloat16 b's
rows equal to the bit, a's prefill and third blocks apart by up to 0.031 (of values up to 4.3):
bf16 roundings of fp32 results that differ in their last bits, from the layers in the prefill
(the Gaudi proposer on vLLM-CPU's layers gives the CPU proposer's values there) and from the
proposers' layouts in the third step (there it gives the tree's: ring of W rows, padded batch,
against a packed context). The greedy walk's smallest margin (chosen candidate's score over the runner-up's)
is 0.0011 in bf16, on a row the two sides compute to the bit; where their states differ it is
0.0064 or more. A draft that differs is reported with both sides' margins at it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from beam_hpu.tiny.dflash2_drafter import DFLASH2_DIR
from tests.support.dflash2_served import FLIP_BOUND, draft_disagreements
from tests.support.dflash2_steps import step_case
from tests.support.gaudi.habana_ops import RMS_NORM_TOLERANCE, ROPE_TOLERANCE
from tests.support.gaudi.hpu_layers import add_platform_entry_point
from tests.support.gaudi.tree import port_tree, proxy_port_tree, run_fresh, run_stubbed

pytestmark = pytest.mark.gaudi_tree
K = 7  # the block: the bonus token and 7 mask tokens (the tiny drafter's block_size)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

STEPS_RUN = r'''
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from tests.support.dflash2_served import tiny_dflash2
from tests.support import dflash2_steps

config = VllmConfig()
if TREE:
    assert config.compilation_config.custom_ops == ["all"], config.compilation_config.custom_ops
case = torch.load(CASE)
steps = dflash2_steps.hpu_steps if TREE else dflash2_steps.cpu_steps
out = {}
with set_current_vllm_config(config):
    for name in DTYPES:
        model = tiny_dflash2(torch_dtype=getattr(torch, name))
        calls = dflash2_steps.layer_calls(model)
        with torch.no_grad():
            out[name] = steps(model, case, K)
        out[name]["layers"] = calls
torch.save(out, OUT)
print("done")
'''
ON_THE_TREE = "from tests.support.gaudi import hpu_layers\nhpu_layers.install()\n" + STEPS_RUN


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    config = json.loads((DFLASH2_DIR / "config.json").read_text())
    width = config["hidden_size"] * len(config["dflash_config"]["target_layer_ids"])
    path = tmp_path_factory.mktemp("dflash2-steps") / "case.pt"
    torch.save(step_case(width, config["max_position_embeddings"]), path)
    return path


def steps_run(tree, case: Path, out: Path) -> dict:
    """Each dtype's drafts, block hidden states and layer calls, in a fresh interpreter: the Gaudi
    proposer on the tree's layers when `tree` is given, the CPU proposer on vLLM-CPU's otherwise."""
    names = dict(CASE=str(case), OUT=str(out), DTYPES=list(DTYPES), TREE=tree is not None, K=K)
    if tree is None:
        run_fresh(STEPS_RUN, timeout=600, **names)
    else:
        run_stubbed(tree.root, ON_THE_TREE, timeout=600, **names)
    return torch.load(out)


@pytest.fixture(scope="module")
def on_cpu(case, tmp_path_factory):
    return steps_run(None, case, tmp_path_factory.mktemp("dflash2-steps-cpu") / "out.pt")


@pytest.fixture(scope="module", params=["091bbadd", "release proxy"])
def on_tree(request, case, tmp_path_factory):
    """The ported 091bbadd tree, then the release proxy with its port profile."""
    tmp = tmp_path_factory.mktemp("dflash2-steps-tree")
    tree = port_tree(tmp / "site") if request.param == "091bbadd" else proxy_port_tree(tmp / "proxy")
    add_platform_entry_point(tree.root)
    return steps_run(tree, case, tmp / "out.pt")


HPU_LAYERS = {"vllm_gaudi.ops.hpu_rotary_embedding.HPURotaryEmbedding.forward_oot",
              "vllm_gaudi.ops.hpu_layernorm.HPURMSNorm.forward_oot"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_step_runs_the_trees_layers(on_tree, on_cpu, dtype):
    """Every RoPE and RMSNorm the drafter ran in the proposer's steps was vllm-gaudi's class through
    forward_oot; the side compared with ran vLLM-CPU's."""
    called = {name for name, n in on_tree[dtype]["layers"].items() if n}
    rope_and_norms = {name for name in called if "Rotary" in name or "RMSNorm" in name}
    assert rope_and_norms == HPU_LAYERS, on_tree[dtype]["layers"]
    cpu_called = {name for name, n in on_cpu[dtype]["layers"].items() if n}
    assert cpu_called and not any("vllm_gaudi" in name for name in cpu_called), on_cpu[dtype]["layers"]


def bound(dtype: str) -> float:
    return RMS_NORM_TOLERANCE[DTYPES[dtype]] + ROPE_TOLERANCE[DTYPES[dtype]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_steps_draft_on_the_tree_as_the_cpu_proposer(on_tree, on_cpu, dtype):
    """Step 1 prefills both; step 2 keeps 2 of a's 7 drafts and 3 of b's 5; step 3 none of either.
    A context row lost or kept wrongly (a rejected draft's state, an earlier step's rows), or a
    block rotated at the wrong positions, moves the hidden states by O(1), far past the bound."""
    tree, cpu = on_tree[dtype], on_cpu[dtype]
    assert len(tree["drafts"]) == len(cpu["drafts"]) == 3
    for step, (got, want) in enumerate(zip(tree["drafts"], cpu["drafts"]), 1):
        assert got.shape == want.shape == (2, K)
        problems = draft_disagreements(got, want, cpu["margins"][step - 1], FLIP_BOUND[DTYPES[dtype]])
        assert not problems, f"step {step}: " + "; ".join(problems)
    for step, (got, want) in enumerate(zip(tree["hidden"], cpu["hidden"]), 1):
        assert got.dtype == want.dtype == DTYPES[dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=bound(dtype), rtol=bound(dtype),
                                   msg=lambda m, step=step: f"step {step}: {m}")
