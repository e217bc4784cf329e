"""card-check's timing on a card takes the server's path: lazy mode set before the bridge loads,
a repeated call replayed from an HPU graph captured on its warm-up, FusedSDPA and the fused FP8 MoE
op in vllm-gaudi's call forms. Shown with the Habana
modules stood in (tests/support/gaudi/habana_stub.py, MagicMocks whose calls are recorded; the
graph wrapper hands its module back, since nothing here can capture), in a fresh interpreter."""

import subprocess
import sys

from tests.support.engines import REPO

RUN = r'''
import os, sys, torch
from tests.support.gaudi import habana_stub
habana_stub.install()
import habana_frameworks.torch as htorch
htorch.hpu.wrap_in_hpu_graph.side_effect = lambda module, **kw: module
from beam_hpu.cardcheck.device import CARD_LABEL, Device, detect
calls = []
device = Device("hpu", CARD_LABEL)
device.median_ms(lambda: calls.append("graphed"), 3, warmup=0)
(args, kwargs), = [c[1:] for c in htorch.hpu.wrap_in_hpu_graph.mock_calls if c[0] == ""]
assert isinstance(args[0], torch.nn.Module) and kwargs == {"disable_tensor_cache": True}, (args, kwargs)
assert calls == ["graphed"] * 4, calls  # one warm-up call captures, three replays are timed
htorch.hpu.wrap_in_hpu_graph.reset_mock()
device.median_ms(lambda: calls.append("eager"), 2, warmup=1, graph=False)
assert not htorch.hpu.wrap_in_hpu_graph.mock_calls and calls.count("eager") == 3
os.environ.pop("PT_HPU_LAZY_MODE", None)
detect(force_cpu=False)
assert os.environ["PT_HPU_LAZY_MODE"] == "1"
# FusedSDPA called as vllm-gaudi calls it under the recipe: the tree tests' stand-in (after the
# bridge's FusedSDPA.py) refuses any softmax mode but fp32 for bf16 inputs, and records the call
import types
from tests.support.gaudi.habana_attention import FusedSDPA
sys.modules["habana_frameworks.torch.hpex.kernels"] = types.SimpleNamespace(FusedSDPA=FusedSDPA)
from beam_hpu.cardcheck.premises import server_fsdpa
q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.bfloat16) for _ in range(3))
bias = torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16)
out = server_fsdpa(0.25)(q, k, v, bias)
assert out.shape == q.shape and FusedSDPA.calls[-1]["mask"] == (1, 1, 8, 8)
# The fused FP8 MoE op as vllm-gaudi's per-channel op calls it: squeezed per-channel scales
seen = {}
def record(**kwargs):
    seen.update(kwargs)
    return torch.zeros(kwargs["hidden_states"].shape, dtype=torch.bfloat16)
torch.ops.hpu = types.SimpleNamespace(mixture_of_experts=types.SimpleNamespace(fp8_fused_weights_dynamic=record))
from beam_hpu.cardcheck.premises import server_fused_moe
E, H, I = 4, 32, 16
w13, w2 = torch.zeros(E, 2 * I, H, dtype=torch.float8_e4m3fn), torch.zeros(E, H, I, dtype=torch.float8_e4m3fn)
quantise = lambda t: (t.to(torch.float8_e4m3fn), torch.ones(t.shape[0], 1))
server_fused_moe(torch.ones(2, H, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.int64),
                 torch.ones(2, 2, dtype=torch.bfloat16), w13, torch.ones(E, 2 * I, 1), w2, torch.ones(E, H, 1), quantise)
assert [s.shape for s in seen["d_scale_w12"]] == [(2 * I,)] * E and [s.shape for s in seen["d_scale_w3"]] == [(H,)] * E
assert [w.shape for w in seen["w12"]] == [(2 * I, H)] * E and seen["permuted_weights"] and seen["experts_max"] == E - 1
print("ok")
'''


def test_a_card_times_repeated_calls_as_hpu_graph_replays_in_lazy_mode_and_calls_fsdpa_as_the_server():
    proc = subprocess.run([sys.executable, "-c", RUN], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
