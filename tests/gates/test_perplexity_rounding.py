"""The live perplexity reference rounds activations as BEAM_EXACT_ROUNDING says (like with like)."""

import torch

from beam_hpu.gates.profile import get_profile
from beam_hpu.reference.in_memory import load_reference, next_token_logprobs
from beam_hpu.reference.live import live_reference


def test_live_reference_follows_the_switch(conditioned_pair, monkeypatch):
    fp8 = conditioned_pair[1]
    ids = list(range(8, 60))
    # bf16, the profile's (the server's) precision: there the fast path's scale is a bf16 number,
    # which moves many roundings. In fp32 the modes part only where x / s and x * (1 / s) straddle
    # an e4m3 midpoint or in rows of amax near 1e-8: on this passage the two fp32 references gave
    # the same numbers (on the test prompts of tests/quant they do not: KL 6e-5).
    profile = get_profile("gaudi")
    refs = {}
    for value in ("1", "0"):
        monkeypatch.setenv("BEAM_EXACT_ROUNDING", value)
        ref = live_reference(fp8, {"p": ids}, 5, profile)
        assert f"BEAM_EXACT_ROUNDING={value}" in ref["reference"]
        refs[value] = ref["passages"][0]["token_logprobs"][1:]
        # The same numbers as the reference loaded in that mode directly.
        direct = next_token_logprobs(load_reference(fp8, dtype=torch.bfloat16, exact=value == "1"), ids)[:-1]
        expected = direct.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(refs[value]), expected, rtol=0, atol=1e-6)
    assert refs["1"] != refs["0"]
    # exact= given explicitly wins over the switch.
    explicit = live_reference(fp8, {"p": ids}, 5, profile, exact=True)
    assert explicit["passages"][0]["token_logprobs"][1:] == refs["1"]
