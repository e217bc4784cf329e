"""How precisely a tiny FP8 Beam's perplexity is defined: the per-token FP8 reference against itself
with every quantised input nudged by one fp32 ulp (x * (1 + 1e-7)) before rounding to FP8, and
against the same weights without activation rounding. If a one-ulp nudge moves perplexity by about
the perplexity gate's bar (1%), that bar cannot separate a correct FP8 serving path from a wrong one
on this model: FP8 rounding boundaries and top-k routing near-ties amplify any difference.

  python benchmarks/fp8_perplexity_noise_floor.py [CHECKPOINT]   (default: the tiny trained Beam, FP8)

Passages are the CPU gate profile's (`beam_hpu.gates.perplexity.cpu_passages`).
"""

import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from beam_hpu import reference as R  # noqa: E402
from beam_hpu.gates import perplexity as P  # noqa: E402
from beam_hpu.gates.profile import get_profile  # noqa: E402


def perplexity(model, ids: list[int]) -> float:
    lp = R.next_token_logprobs(model, ids)
    return math.exp(-sum(float(lp[i - 1][ids[i]]) for i in range(1, len(ids))) / (len(ids) - 1))


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        if len(sys.argv) > 1:
            checkpoint = Path(sys.argv[1])
        else:
            from beam_hpu.quant.fp8_checkpoint import quantize_checkpoint
            from beam_hpu.train_tiny import TRAINED_DIR

            checkpoint = quantize_checkpoint(TRAINED_DIR, Path(d) / "fp8")
        tok = AutoTokenizer.from_pretrained(str(checkpoint))

        class Tokenizer:  # cpu_passages asks an endpoint to tokenize; the local tokenizer is the same
            def tokenize(self, text):
                return tok(text, add_special_tokens=False).input_ids

        passages = P.cpu_passages(Tokenizer(), get_profile("cpu"))
        ref = R.load_reference(checkpoint)
        base = {n: perplexity(ref, ids) for n, ids in passages.items()}

        def nudged(x, fp8_max=R.FP8_E4M3FN_MAX):
            return R.fake_quant_per_token(x * (1 + 1e-7), fp8_max)

        for m in ref.beam_fp8_modules:
            setattr(m, R.INPUT_QUANT_ATTR, nudged)
        rows = {"inputs nudged by one fp32 ulp": {n: perplexity(ref, ids) for n, ids in passages.items()}}
        weight_only = R.load_oracle(checkpoint, torch.float32)
        rows["no activation rounding (weights FP8 only)"] = {n: perplexity(weight_only, ids) for n, ids in passages.items()}
        print(f"{checkpoint}: per-token FP8 reference (fp32) perplexity " +
              " / ".join(f"{n} {v:.1f}" for n, v in base.items()))
        for what, ppl in rows.items():
            print(f"  {what}: " + " / ".join(f"{ppl[n] / base[n] - 1:+.2%}" for n in passages))


if __name__ == "__main__":
    main()
