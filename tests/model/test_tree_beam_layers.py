"""The tiny trained Beam (bf16) on the vllm-gaudi tree's own layers against the same weights on
vLLM-CPU's, module by module, without the attention backend (skipped without a tree).

In a fresh interpreter vLLM picks the tree's HpuPlatform and the tree's register_ops() fills its
out-of-tree registry (tests/support/gaudi/hpu_layers.py), so Beam's RMSNorms are HPURMSNorm, its
RoPE HPURotaryEmbedding, each through forward_oot, and its MoE layers take the tree's unquantised
MoE method through the tree's patched runner forward. The model is built there, and in a second
fresh interpreter on vLLM-CPU, by vLLM's own loader from the committed checkpoint (tests/support/gaudi/beam_layers.py). Every attention
kernel is replaced on both sides by the same plain causal window attention: the attention backend is
not under test here.

The whole model also runs in the layout vllm-gaudi's model adapter hands Beam a prompt in
(input_ids and positions [1, S]), and with the adapter's own cos/sin protocol (its methods, from the
runner file): the first RotaryEmbedding it finds prepared once from the step's positions.

Here the model runs once on a prompt and every compared module's inputs are kept; both sides then
call each module on exactly those inputs, so a module's difference is its own. The whole model also
runs on both sides, its logits compared. What that forward called of vllm-gaudi's overrides and
the Habana ops is traced (tests/support/gaudi/trace.py) and must be the Beam rows of the table in
beam_hpu/runtime/README.md.

Habana kernels: hpex FusedRMSNorm and apply_rotary_pos_emb, and torch.ops.hpu.mixture_of_experts
(the fused_weights overload), are tests/support/gaudi/habana_ops.py's stand-ins after the bridge's
public source. Any other torch.ops.hpu name the forward asks for is an AttributeError naming it,
and recorded: the test fails if there is one. The Habana Python modules are MagicMocks
(habana_stub.py); the test records every call made on them during the forward and fails on any
whose result was used (only calls whose result nothing reads are allowed).

vLLM 0.30.0 versus the public tree: the tree's MoE glue calls three vLLM APIs as vLLM main has
them; beam_layers.bridge_vllm_gaps bridges them in vLLM's modules (never the tree) and the test
asserts which it bridged, so the list cannot go stale.

Bounds (bf16):
- the RMSNorms (input, post-attention, pre/post-feedforward with the fused residual add and the
  depth-scaled eps, Q/K norms, final norm): atol = rtol = RMS_NORM_TOLERANCE (0.015), what Habana's
  card test accepts of FusedRMSNorm against its fp32 reference;
- RoPE on q and k: atol = rtol = ROPE_TOLERANCE (0.012), Habana's card test of apply_rotary_pos_emb;
- BeamAttention as a whole (Q/K norms, then RoPE, then the same attention and linears):
  RMS_NORM_TOLERANCE + ROPE_TOLERANCE, as the drafter's tree test;
- the linears, the router (fp32 F.linear) and the embedding run vLLM's own code on both sides
  (vllm-gaudi overrides none of them unquantised): equal up to one bf16 rounding (rtol 2**-8);
- the MoE experts: no Habana card test of mixture_of_experts was found; the stand-in rounds to bf16
  seven times per expert (gate and up GEMMs, SiLU, product, down GEMM, router weight, running sum),
  so each output element is held within 8 bf16 unit roundoffs (8 * 2**-8) of its row's largest
  magnitude;
- routing: the same experts per token, their weights within fp32 rounding;
- whole-model logits (every module above chained through five layers, soft-capped at 30):
  LOGIT_BOUND = 1.0, which no Habana tolerance gives (none composes through a model): measured
  0.59 on this prompt; greedy tokens equal wherever vLLM-CPU's top-2 margin exceeds twice that
  bound (most positions; where it does not, the tree's token must be within the bound of vLLM-CPU's
  best: one position of 47 flips so).
Measured, as fractions of each bound: RoPE 0.56 (one bf16 ulp), BeamAttention 0.63, the norms up
to 0.42, the MoE 0.34; the linears, the router and the embedding bit-equal.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.gaudi import trace_table
from tests.support.gaudi.habana_ops import RMS_NORM_TOLERANCE, ROPE_TOLERANCE
from tests.support.gaudi.hpu_layers import add_platform_entry_point
from tests.support.gaudi.tree import port_tree, run_fresh, run_stubbed

pytestmark = pytest.mark.gaudi_tree

BF16 = torch.bfloat16
NORM, ROPE = RMS_NORM_TOLERANCE[BF16], ROPE_TOLERANCE[BF16]
ONE_ROUNDING = 2.0**-8
MOE_ROW_BOUND = 8 * 2.0**-8
LOGIT_BOUND = 1.0
# The whole calls allowed on the Habana MagicMocks during the forward: their results are not read.
UNREAD_MOCK_CALLS = {"synchronize", "mark_step"}

ON_THE_TREE = r'''
import sys, torch
from tests.support.gaudi.beam_layers import as_on_the_node
hpu_ops = as_on_the_node()
from tests.support.gaudi.trace import Trace
trace = Trace()
from tests.support.gaudi import beam_layers as bl
bridged = bl.bridge_vllm_gaps()
from vllm.config import VllmConfig
assert VllmConfig().compilation_config.custom_ops == ["all"]
model, config = bl.build()
bl.without_attention_backend(model)
case = torch.load(CASE)
routing = bl.RoutingTrace(model)
stubs = [sys.modules["habana_frameworks"], torch.hpu]
build_mock_calls = sorted({str(c).split("(")[0] for stub in stubs for c in stub.mock_calls})
for stub in stubs:
    stub.reset_mock()
with bl.TreeCalls(ROOT) as calls, trace.recording():
    out = bl.replay(model, case["inputs"], config)
    logits = bl.logits(model, case["ids"], case["positions"], config)
mock_calls = sorted({str(c).split("(")[0] for stub in stubs for c in stub.mock_calls})
routed = list(routing.calls)
# The layout vllm-gaudi's adapter hands Beam a prompt in ([B, S]: Beam is not a flatten_input model)
batched = bl.logits(model, case["ids"][None], case["positions"][None], config)
# The model adapter's cos/sin protocol, with its own methods (HpuModelAdapter in the runner file,
# which vLLM 0.30.0 cannot import whole): it finds the first RotaryEmbedding in the model, prepares
# its cos/sin from the step's positions before the forward (VLLM_COS_SIN_RECOMPUTE off, the
# default), and drops them after.
from pathlib import Path
from types import SimpleNamespace
from tests.support.gaudi.source import RUNNER, load
runner = Path(ROOT) / RUNNER
adapter = SimpleNamespace(recompute_cos_sin=False)
find = load(runner, "_get_rotary_embedding_module", "HpuModelAdapter")
adapter._get_rotary_embedding_module = lambda m: find(adapter, m)
adapter._rotary_embed_module = adapter._get_rotary_embedding_module(model)
prepare = load(runner, "_get_prepare_cos_sin", "HpuModelAdapter")(adapter)
prepare(case["positions"][None], recompute_cos_sin=adapter.recompute_cos_sin)
prepared = bl.logits(model, case["ids"][None], case["positions"][None], config)
load(runner, "_reset_rotary_cos_sin", "HpuModelAdapter")(adapter)
adapter_rope = [i for i, layer in enumerate(model.model.layers)
                if getattr(layer.self_attn, "rotary_emb", None) is adapter._rotary_embed_module]
torch.save({"out": out, "logits": logits, "batched": batched, "routing": routed, "build_mock_calls": build_mock_calls,
            "prepared": prepared, "adapter_rope": adapter_rope, "missing": hpu_ops.missing,
            "bridged": bridged, "reached": bl.reached(model), "tree_calls": sorted(calls.seen),
            "mock_calls": mock_calls, "shared_rope": bl.shared_rope(model), "eps": bl.norm_eps(model),
            "trace": trace.records()}, OUT)
print("done")
'''


ON_VLLM_CPU = r'''
import torch
from transformers import AutoTokenizer
from beam_hpu.tiny.checkpoint import TRAINED_DIR
from tests.support.gaudi import beam_layers as bl
from tests.support.prompts import PROMPTS
model, config = bl.build()
bl.without_attention_backend(model)
# Real text the model was trained on, longer than its sliding window (32).
ids = torch.tensor(AutoTokenizer.from_pretrained(str(TRAINED_DIR)).encode(" ".join(PROMPTS[:2])))
assert ids.numel() > 32
positions = torch.arange(ids.numel())
inputs = bl.record_inputs(model, ids, positions, config)
routing = bl.RoutingTrace(model)
out = bl.replay(model, inputs, config)
torch.save({"case": {"inputs": inputs, "ids": ids, "positions": positions}, "out": out,
            "logits": bl.logits(model, ids, positions, config), "routing": list(routing.calls),
            "eps": bl.norm_eps(model)}, OUT)
print("done")
'''


@pytest.fixture(scope="module")
def on_cpu(tmp_path_factory):
    """vLLM-CPU's side, in a fresh interpreter as the tree's: nothing an earlier test left in this
    process (vLLM's caches, torch's settings) reaches the comparison."""
    out = tmp_path_factory.mktemp("beam-layers-cpu") / "out.pt"
    run_fresh(ON_VLLM_CPU, timeout=900, OUT=str(out))
    return torch.load(out)


@pytest.fixture(scope="module")
def on_tree(on_cpu, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("beam-layers")
    tree = port_tree(tmp / "site")
    add_platform_entry_point(tree.root)
    torch.save(on_cpu["case"], tmp / "case.pt")
    run_stubbed(tree.root, ON_THE_TREE, timeout=900, CASE=str(tmp / "case.pt"), OUT=str(tmp / "out.pt"),
                ROOT=str(tree.root))
    return torch.load(tmp / "out.pt")


def test_the_tree_misses_three_vllm_0_30_apis_on_the_moe_path(on_tree):
    """What bridge_vllm_gaps had to bridge: when the tree takes 0.30.0's APIs this fails, and the
    bridge goes."""
    assert on_tree["bridged"] == ["create_fused_moe_router(bias_vl, image_sentinel_lo)",
                                  "fused_moe.experts.cpu_moe.select_experts",
                                  "MoERunner._maybe_sync_shared_experts_stream"]


def test_beams_modules_reach_the_trees_layers(on_tree):
    reached = on_tree["reached"]
    norms = {n: m for n, m in reached.items() if n.endswith("norm")}
    assert set(norms.values()) == {"vllm_gaudi.ops.hpu_layernorm.HPURMSNorm.forward_oot"}, norms
    assert len(norms) == 5 * 6 + 1
    ropes = {n: m for n, m in reached.items() if n.endswith("rotary_emb")}
    assert set(ropes) == {f"model.layers.{i}.self_attn.rotary_emb" for i in (0, 1, 3)}  # the sliding layers
    assert set(ropes.values()) == {"vllm_gaudi.ops.hpu_rotary_embedding.HPURotaryEmbedding.forward_oot"}
    for i in (1, 2, 3, 4):
        assert reached[f"model.layers.{i}.mlp.experts.quant_method"] == \
            "vllm_gaudi.ops.hpu_fused_moe.HPUUnquantizedFusedMoEMethod"
    calls = set(on_tree["tree_calls"])
    for call in ("vllm_gaudi/ops/hpu_layernorm.py:HPURMSNorm.forward_oot",
                 "vllm_gaudi/ops/hpu_rotary_embedding.py:HPURotaryEmbedding.forward_oot",
                 "vllm_gaudi/ops/hpu_fused_moe.py:patched_fused_moe_forward",
                 "vllm_gaudi/ops/hpu_fused_moe.py:HPUUnquantizedFusedMoEMethod.apply_monolithic",
                 "vllm_gaudi/ops/hpu_fused_moe.py:select_experts_from_routed",
                 "vllm_gaudi/extension/ops.py:VllmMixtureOfExpertsOp.forward"):
        assert call in calls, sorted(calls)


def test_the_tree_routes_beam_without_its_grouped_topk_override(on_tree):
    """Beam's router is grouped sigmoid top-k, and the tree registers HPUGroupedTopk for it
    (ops/hpu_grouped_topk_router.py), which the runner's GroupedTopKRouter holds; but the tree's
    unquantised MoE method is monolithic and routes itself (select_experts_from_routed, vLLM's CPU
    routing function), so no code of that file runs in Beam's forward. When it does, this fails and
    the comparison above covers it."""
    assert on_tree["reached"]["model.layers.1.mlp.experts.router"] == \
        "vllm.model_executor.layers.fused_moe.router.grouped_topk_router.GroupedTopKRouter"
    assert not [c for c in on_tree["tree_calls"] if "hpu_grouped_topk_router" in c]


def test_every_norm_keeps_its_depth_scaled_eps(on_tree, on_cpu):
    """The eps differences are far below what the outputs' bound can see (1e-6 against values of
    order 1), so they are compared as the layers hold them: HPURMSNorm.forward_oot hands its
    variance_epsilon to FusedRMSNorm."""
    assert on_tree["eps"] == on_cpu["eps"]
    assert len(set(on_cpu["eps"].values())) > 5


def test_one_rope_module_serves_every_sliding_layer(on_tree):
    """vllm-gaudi's model adapter prepares cos/sin once per step on the first RotaryEmbedding it
    finds; Beam's sliding layers share one (get_rope's cache), so the one it finds serves them all,
    and the model's logits with the adapter's prepared cos/sin are those computed per call."""
    assert on_tree["shared_rope"] == on_tree["adapter_rope"] == [0, 1, 3]
    torch.testing.assert_close(on_tree["prepared"], on_tree["logits"], atol=0, rtol=0)


def test_no_habana_op_without_a_stand_in_and_no_mock_result(on_tree):
    """The forward asks the Habana mocks nothing whose answer it reads; building, the tree asks the
    device type (extension/ops.py: is_hpu_gaudi2, read by its FP8 paths) and the bridge mode, both
    pinned to the node's answers above, and synchronizes."""
    assert on_tree["missing"] == []
    assert {c.rsplit(".", 1)[-1] for c in on_tree["mock_calls"]} <= UNREAD_MOCK_CALLS, on_tree["mock_calls"]
    assert on_tree["build_mock_calls"] == [
        "call.synchronize", "call.torch.utils.experimental._get_device_type",
        "call.torch.utils.experimental.synDeviceType.synDeviceGaudi2.__eq__",
        "call.torch.utils.experimental.synDeviceType.synDeviceGaudi3.__eq__", "call.torch.utils.internal.is_lazy"]


def _bound(name: str) -> tuple[float, float] | None:
    """(atol, rtol) for a module's output, None for the MoE (row-relative, below)."""
    if name.endswith(("mlp.experts", "mlp")) and "layers.0." not in name:
        return None
    if name.endswith("rotary_emb"):
        return ROPE, ROPE
    if name.endswith("self_attn"):
        return NORM + ROPE, NORM + ROPE
    if name.endswith("norm"):
        return NORM, NORM
    return 1e-6, ONE_ROUNDING


def _tensors(value):
    return [v for v in (value if isinstance(value, (tuple, list)) else (value,)) if isinstance(v, torch.Tensor)]


def test_every_module_on_the_tree_is_vllm_cpus(on_tree, on_cpu):
    cpu, tree = on_cpu["out"], on_tree["out"]
    assert set(cpu) == set(tree)
    assert len(cpu) == 69  # 68 modules and compute_logits
    for name in cpu:
        for a, b in zip(_tensors(cpu[name]), _tensors(tree[name]), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            bound = _bound(name)
            if bound is None:
                row = a.float().abs().amax(-1, keepdim=True)
                excess = ((a.float() - b.float()).abs() - MOE_ROW_BOUND * row).max()
                assert excess <= 0, f"{name}: past the bound by {excess}"
            else:
                torch.testing.assert_close(b.float(), a.float(), atol=bound[0], rtol=bound[1],
                                           msg=lambda m, name=name: f"{name}: {m}")


def test_routing_on_the_tree_is_vllm_cpus(on_tree, on_cpu):
    """Each MoE layer replayed (BeamMoE, then its runner): the same experts per token, the same fp32
    weights. Then the whole model's four MoE layers, on hidden states that already differ by the
    modules before them: the same experts."""
    assert len(on_tree["routing"]) == len(on_cpu["routing"]) == 12
    for k, ((tw, ti), (cw, ci)) in enumerate(zip(on_tree["routing"], on_cpu["routing"])):
        t_order, c_order = ti.long().sort(-1), ci.long().sort(-1)
        assert torch.equal(t_order.values, c_order.values), k
        if k < 8:
            torch.testing.assert_close(tw.float().gather(-1, t_order.indices),
                                       cw.float().gather(-1, c_order.indices))


def test_the_tree_takes_a_prompt_in_the_adapters_layout(on_tree):
    """input_ids and positions [1, S], as HpuModelAdapter passes them for Beam: the same logits as
    the flat [S] run on the same layers."""
    torch.testing.assert_close(on_tree["batched"], on_tree["logits"], atol=0, rtol=0)


def test_the_whole_model_on_the_tree_decides_as_on_vllm_cpu(on_tree, on_cpu):
    cpu, tree = on_cpu["logits"], on_tree["logits"]
    assert (cpu - tree).abs().max() <= LOGIT_BOUND
    top2 = cpu.topk(2, -1).values
    decided = top2[:, 0] - top2[:, 1] > 2 * LOGIT_BOUND
    assert decided.float().mean() > 0.5
    assert torch.equal(tree.argmax(-1)[decided], cpu.argmax(-1)[decided])
    best = cpu.gather(-1, tree.argmax(-1, keepdim=True)).squeeze(-1)
    assert (top2[:, 0] - best <= LOGIT_BOUND).all()


def test_the_trace_table_lists_what_beam_reached(on_tree):
    """beam_hpu/runtime/README.md's tree-trace table, its rows reached by Beam, against what this
    run's forward called (tests/support/gaudi/trace.py)."""
    trace_table.keep(on_tree["trace"], "Beam")
    assert on_tree["trace"], "the trace recorded nothing"
    stale = trace_table.differences(on_tree["trace"], "Beam")
    assert stale == [], ("the tree-trace table is not this run's (python -m tests.support.gaudi.trace_table "
                         "--write):\n" + "\n".join(stale))
