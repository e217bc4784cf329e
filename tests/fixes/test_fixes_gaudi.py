"""vllm-gaudi-side fixes against a vllm-gaudi tree named by GAUDI_FIXES_ROOT.

Each test copies the tree's vllm_gaudi/ package to a temp root (the given tree is never
written), applies the profile's vllm-gaudi fixes there, and runs the patched logic on CPU with the
Habana modules stubbed. Set GAUDI_FIXES_PROFILE for a tree other than public main (default: the
stand-in profile v0.30.0-public-main).
"""
from __future__ import annotations

import ast

import pytest

from fixes.engine import EXIT_OK, run
from tests.support.gaudi.fix_trees import tree_digest
from tests.support.gaudi.tree import PROFILE, apply_fixes, copy_tree, gaudi_units, run_stubbed, tree_profile

pytestmark = pytest.mark.gaudi_tree


@pytest.fixture
def gaudi_tree(tmp_path):
    return copy_tree(tmp_path / "site")


def test_apply_twice_and_every_file_parses(gaudi_tree):
    root, checkouts = gaudi_tree
    first = apply_fixes(root, checkouts)
    assert first.exit_code == EXIT_OK, first.lines
    assert set(first.states.values()) == {"applied"}, first.lines
    for unit in tree_profile(PROFILE).fixes:
        for rel in unit.files if unit.package == "vllm_gaudi" else []:
            ast.parse((root / rel).read_text())
    before = tree_digest(root)
    second = apply_fixes(root, checkouts)
    assert second.exit_code == EXIT_OK
    assert set(second.states.values()) == {"already applied"}, second.lines
    assert tree_digest(root) == before
    assert run(tree_profile(PROFILE), roots={"vllm_gaudi": str(root)}, checkouts=checkouts,
               only=gaudi_units(tree_profile(PROFILE)), check=True).exit_code == EXIT_OK


MOE_CALL = """
import types, torch
import vllm_gaudi.extension.ops as ops
assert ops.__file__.startswith(%r), ops.__file__  # the temp copy, not an installed one

class Packet:
    # The op's overload packet: calling it is what the stock code does; named attributes are
    # the explicit overloads this build has.
    def __init__(self, overloads, calls):
        self._overloads, self._calls = overloads, calls
    def __call__(self, **kwargs):
        self._calls.append("packet")
        return kwargs["hidden_states"].float()
    def __getattr__(self, name):
        if name not in self._overloads:
            raise AttributeError(name)
        def overload(**kwargs):
            self._calls.append(name)
            return kwargs["hidden_states"].float()
        return overload

def forward(overloads, static):
    calls = []
    torch.ops.hpu = types.SimpleNamespace(
        mixture_of_experts=Packet(overloads, calls),
        cast_to_fp8_v2=lambda x, inv_scale, *rest: ((x * inv_scale).to(torch.float8_e4m3fn),))
    op = ops.VllmMixtureOfExpertsOpFP8PerChannel.__new__(ops.VllmMixtureOfExpertsOpFP8PerChannel)
    torch.nn.Module.__init__(op)
    op.num_experts, op.experts_min, op.experts_max = 2, 0, 1
    op.is_gated = True  # what __init__ sets where forward reads it (the release's non-gated experts)
    op._get_extra_kwargs = lambda tokens: {}
    op._cached_w13_views = op._cached_w2_views = (torch.zeros(1),) * 2
    op._cached_w13_scale_views = op._cached_w2_scale_views = (torch.ones(1),) * 2
    op.w13_input_scale = torch.nn.Parameter(torch.tensor(0.5)) if static else None
    op.w2_input_scale = [torch.tensor(1.0)] * 2 if static else None
    op.forward(torch.randn(3, 4), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2))
    return calls

every = {"fp8_fused_weights_dynamic", "fp8_fused_weights"}
print(forward(every, static=False), forward(every, static=True), forward(set(), static=False))
"""


@pytest.mark.parametrize("stock", [True, False])
def test_moe_explicit_overload(gaudi_tree, stock):
    root, checkouts = gaudi_tree
    if not stock:
        assert apply_fixes(root, checkouts).exit_code == EXIT_OK
    out = run_stubbed(root, MOE_CALL % str(root))
    if stock:
        assert out == "['packet'] ['packet'] ['packet']"
    else:  # explicit overloads; the packet only when the build lacks the overload
        assert out == "['fp8_fused_weights_dynamic'] ['fp8_fused_weights'] ['packet']"


def so_branch_orders(source: str) -> tuple[list[str], list[str]]:
    """In sample_tokens' structured-output branch: (order of the logits rows, order of the
    request ids given to _run_sampling), each as the names of the pieces concatenated."""
    tree = ast.parse(source)
    sample = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "sample_tokens")
    branch = next(n for n in ast.walk(sample) if isinstance(n, ast.If)
                  and ast.unparse(n.test) == "self.use_structured_output")
    rows = next(n.value for n in ast.walk(branch) if isinstance(n, ast.Assign)
                and ast.unparse(n.targets[0]) == "logits_combined")
    call = next(n for n in ast.walk(branch) if isinstance(n, ast.Call)
                and ast.unparse(n.func) == "self._run_sampling")
    pieces = lambda expr: [ast.unparse(expr.left), ast.unparse(expr.right)]  # noqa: E731
    return ([p.removeprefix("logits_") for p in pieces(rows)],
            [p.removeprefix("pd_info.").removesuffix("_req_ids") for p in pieces(call.args[2])])


@pytest.mark.parametrize("stock", [True, False])
def test_structured_output_rows_follow_the_logits(gaudi_tree, stock):
    """Structural: the real sample_tokens must take the request ids in the rows' order. (The
    mixed prompt+decode sampling step itself is not run on CPU here.)"""
    root, checkouts = gaudi_tree
    if not stock:
        assert apply_fixes(root, checkouts).exit_code == EXIT_OK
    rows, ids = so_branch_orders((root / "vllm_gaudi/v1/worker/hpu_model_runner.py").read_text())
    assert rows == ["decode", "prompt"]
    assert (ids == rows) is (not stock)
