"""How precisely a tiny FP8 Beam's perplexity is defined, over all positions and over the positions
the gate scores (where the model was trained to predict; `beam_hpu.gates.perplexity`).

The per-token FP8 reference (fp32) against: itself computed in bf16 (the server's precision), itself
with every quantised input nudged by one fp32 ulp (x * (1 + 1e-7)) before rounding to FP8, and the
same weights without activation rounding. If such a change moves perplexity by about the gate's bar
(1%), the bar cannot separate a correct FP8 serving path from a wrong one on those positions: FP8
rounding boundaries and top-k routing near-ties amplify any difference.

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

from beam_hpu.reference import in_memory as R  # noqa: E402
from beam_hpu.gates import perplexity as P  # noqa: E402
from beam_hpu.gates.profile import get_profile  # noqa: E402


def logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len-1]: log p(token i | < i) for i >= 1, and the full rows for KL."""
    return R.next_token_logprobs(model, ids)[:-1].float()


def compare(base: torch.Tensor, other: torch.Tensor, ids: list[int], positions: list[int]) -> str:
    at = torch.tensor([i - 1 for i in positions])
    tgt = torch.tensor([ids[i] for i in positions])
    b, o = base[at], other[at]
    change = math.exp(-o.gather(1, tgt[:, None]).mean()) / math.exp(-b.gather(1, tgt[:, None]).mean()) - 1
    kl = float((b.exp() * (b - o)).sum(-1).mean())
    return f"{change:+.2%} KL {kl:.4f}"


def checkpoint_and_passages(workdir: str) -> tuple[Path, dict]:
    """The checkpoint named on the command line, or the tiny trained Beam quantised into `workdir`;
    and the CPU gate profile's passages for it (name -> (token ids, scored flags))."""
    if len(sys.argv) > 1:
        checkpoint = Path(sys.argv[1])
    else:
        from beam_hpu.quant.fp8_checkpoint import quantize_checkpoint
        from beam_hpu.tiny.checkpoint import TRAINED_DIR

        checkpoint = quantize_checkpoint(TRAINED_DIR, Path(workdir) / "fp8")
    tok = AutoTokenizer.from_pretrained(str(checkpoint))

    class Tokenizer:  # cpu_passages asks an endpoint to tokenize; the local tokenizer is the same
        def tokenize(self, text):
            return tok(text, add_special_tokens=False).input_ids

    return checkpoint, P.cpu_passages(Tokenizer(), get_profile("cpu"), checkpoint)


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        checkpoint, passages = checkpoint_and_passages(d)
        nudged = R.load_reference(checkpoint)
        for m in nudged.beam_fp8_modules:
            setattr(m, R.INPUT_QUANT_ATTR, lambda x, fp8_max=R.FP8_E4M3FN_MAX: R.fake_quant_per_token(x * (1 + 1e-7), fp8_max))
        models = {"reference in bf16": R.load_reference(checkpoint, dtype=torch.bfloat16),
                  "inputs nudged by one fp32 ulp": nudged,
                  "no activation rounding (weights FP8 only)": R.load_oracle(checkpoint, torch.float32)}
        base_model = R.load_reference(checkpoint)
        print(f"{checkpoint}: per-token FP8 reference (fp32) vs each variant, perplexity change and mean KL")
        for name, (ids, scored) in passages.items():
            base = logprobs(base_model, ids)
            every = list(range(1, len(ids)))
            trained = [i for i in every if scored[i]]
            print(f"{name} ({len(ids)} tokens, {len(trained)} scored)")
            for what, model in models.items():
                other = logprobs(model, ids)
                print(f"  {what:42s} all positions {compare(base, other, ids, every):22s} "
                      f"scored positions {compare(base, other, ids, trained)}")


if __name__ == "__main__":
    main()
