"""Fast checks of the gate suite's pieces (no server)."""

import json
import random

import pytest
import torch

from beam_hpu.tiny import tasks as syn
from beam_hpu.gates.perplexity import coarse_kl
from beam_hpu.gates.profile import get_profile
from beam_hpu.gates.result import GateResult, table, write_json
from beam_hpu.reference import live
from beam_hpu.reference.file_format import FORMAT


def test_coarse_kl_is_zero_for_equal_and_a_lower_bound_of_the_full_kl():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        p = torch.log_softmax(torch.randn(50, generator=g) * 2, -1)
        q = torch.log_softmax(torch.randn(50, generator=g) * 2, -1)
        full = float((p.exp() * (p - q)).sum())
        top = lambda lp: {int(i): float(lp[i]) for i in lp.topk(10).indices}  # noqa: E731
        assert coarse_kl(top(p), top(p)) == pytest.approx(0.0, abs=1e-9)
        est = coarse_kl(top(p), top(q))
        assert 0.0 <= est <= full + 1e-9


def test_needle_prompt_plants_the_needle_at_depth_and_the_control_has_none():
    hay = "x" * 1000
    p = syn.needle_prompt(hay, "abcde", "1234", 0.5)
    assert p.index("The code for abcde is 1234.") == pytest.approx(500, abs=2)
    assert p.endswith(syn.needle_question("abcde"))
    assert "1234" not in syn.needle_prompt(hay, "abcde", None, 0.5)


def test_tool_conversations_render_and_are_valid_against_their_schemas(tokenizer):
    import jsonschema

    rng = random.Random(0)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in syn.TOOLS}
    for _ in range(50):
        tools, messages = syn.tool_conversation(rng)
        for call in messages[-1].get("tool_calls", []):
            assert call["function"]["name"] in {t["function"]["name"] for t in tools}
            jsonschema.validate(call["function"]["arguments"], schemas[call["function"]["name"]])
        tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)


def test_profiles_cpu_is_smaller_than_gaudi():
    cpu, gaudi = get_profile("cpu"), get_profile("gaudi")
    assert max(cpu.needle_lengths) < 1024 < min(gaudi.needle_lengths)
    assert len(gaudi.smoke_prompts) == 20 and gaudi.isolation_requests == cpu.isolation_requests == 8
    with pytest.raises(ValueError):
        get_profile("tpu")


def test_table_and_json(tmp_path):
    rs = [GateResult("copy", True, "64/64 | ok"), GateResult("stress", False, "1/2 complete")]
    t = table(rs)
    assert "| copy | 64/64 / ok | PASS |" in t and "| stress | 1/2 complete | FAIL |" in t
    write_json(rs, tmp_path / "g.json", {"model": "m"})
    d = json.loads((tmp_path / "g.json").read_text())
    assert d["passed"] is False and [g["gate"] for g in d["gates"]] == ["copy", "stress"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from beam_hpu.tiny.checkpoint import write_tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return AutoTokenizer.from_pretrained(str(d))


class _ModelEndpoint:
    """Stands in for a server: prompt_logprobs from a transformers model, optionally perturbed."""

    def __init__(self, model, noise=0.0):
        self.model, self.noise = model, noise

    def prompt_top(self, ids, k):
        from beam_hpu.reference.in_memory import next_token_logprobs

        lp = next_token_logprobs(self.model, ids)
        if self.noise:
            g = torch.Generator().manual_seed(0)
            lp = torch.log_softmax(lp + self.noise * torch.randn(lp.shape, generator=g), -1)
        out = [None]
        for i in range(1, len(ids)):
            v, t = lp[i - 1].topk(k)
            d = {int(a): float(b) for a, b in zip(t, v)}
            d[ids[i]] = float(lp[i - 1, ids[i]])
            out.append((d, int(t[0])))
        return out


def test_perplexity_gate_from_a_stored_reference_file_passes_same_and_fails_perturbed(tmp_path):
    from beam_hpu.gates import perplexity
    from beam_hpu.reference.in_memory import load_oracle
    from beam_hpu.tiny.checkpoint import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", "small", dtype="float32")
    passages = {"a": list(range(8, 72)), "b": [9, 10, 11] * 20}
    ref_file = tmp_path / "ref.json"
    # Like with like: the stand-in server below computes in fp32, so the reference does too (a bf16
    # reference against an fp32 server moves this random-weight passage's perplexity by about the
    # 1% bar, by an amount that depends on the host's bf16 kernels).
    fp32 = get_profile("gaudi", reference_dtype="float32")
    live.write_reference_file(ckpt, passages, ref_file, fp32, k=10)
    stored = json.loads(ref_file.read_text())
    assert stored["format"] == FORMAT and len(stored["passages"]) == 2
    model = load_oracle(ckpt, torch.float32)
    same = perplexity.run(_ModelEndpoint(model), get_profile("gaudi"), reference_file=ref_file)
    assert same.passed, same.result
    bad = perplexity.run(_ModelEndpoint(model, noise=1.0), get_profile("gaudi"), reference_file=ref_file)
    assert not bad.passed, bad.result


class _CorruptAt(_ModelEndpoint):
    """A server whose prompt logprobs are wrong at the given positions only (the true token's
    logprob lowered by 3 nats, the top token swapped for it)."""

    def __init__(self, model, positions):
        super().__init__(model)
        self.positions = set(positions)

    def prompt_top(self, ids, k):
        out = super().prompt_top(ids, k)
        for i in self.positions:
            lps, top = out[i]
            lps = dict(lps)
            lps[ids[i]] -= 3.0
            out[i] = (lps, ids[i] + 1 if top == ids[i] else top)
        return out


def test_perplexity_gate_counts_only_the_scored_positions(tmp_path):
    from beam_hpu.gates import perplexity
    from beam_hpu.reference.in_memory import load_oracle
    from beam_hpu.tiny.checkpoint import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", "small", dtype="float32")
    ids = list(range(8, 48))
    scored = [False] * 20 + [True] * 20
    ref_file = tmp_path / "ref.json"
    fp32 = get_profile("gaudi", reference_dtype="float32")  # the stand-in server below computes in fp32
    live.write_reference_file(ckpt, {"half": (ids, scored)}, ref_file, fp32, k=10)
    stored = json.loads(ref_file.read_text())["passages"][0]
    assert stored["scored"] == [int(x) for x in scored]
    model = load_oracle(ckpt, torch.float32)
    unscored_wrong = perplexity.run(_CorruptAt(model, range(1, 20)), get_profile("gaudi"), reference_file=ref_file)
    assert unscored_wrong.passed, unscored_wrong.result
    assert unscored_wrong.details["passages"][0]["scored"] == 20
    scored_wrong = perplexity.run(_CorruptAt(model, [25, 30]), get_profile("gaudi"), reference_file=ref_file)
    assert not scored_wrong.passed, scored_wrong.result
    with pytest.raises(ValueError, match="position 0"):
        live.write_reference_file(ckpt, {"bad": (ids, [True] * len(ids))}, ref_file, fp32)


def test_cpu_passages_score_what_the_tiny_model_was_trained_to_predict():
    """Copy passages are scored on the repeat (after its first token), conversations on the
    assistant turns: the scored tokens are exactly the copied half / the assistant's text."""
    from transformers import AutoTokenizer

    from beam_hpu.gates import perplexity
    from beam_hpu.tiny.checkpoint import TRAINED_DIR

    tok = AutoTokenizer.from_pretrained(str(TRAINED_DIR))

    class Local:
        def tokenize(self, text):
            return tok(text, add_special_tokens=False).input_ids

    profile = get_profile("cpu")
    passages = perplexity.cpu_passages(Local(), profile, TRAINED_DIR)
    assert len(passages) == len(profile.ppl_passage_tokens) + len(profile.ppl_conversations)
    for n in profile.ppl_passage_tokens:
        ids, scored = passages[f"copy-{n}"]
        half = len(ids) // 2
        assert ids[:half] == ids[half:2 * half] and not any(scored[:half + 1]) and all(scored[half + 1:])
    ids, scored = passages["tools-0"]
    assert not scored[0] and 0 < sum(scored) < len(ids)
    text = tok.decode([t for t, s in zip(ids, scored) if s])
    assert "<|call|>" in text or "<|return|>" in text  # the assistant's turn end is predicted
    assert "get_" not in tok.decode([t for t, s in zip(ids, scored) if not s]).split("<|start|>assistant")[-1]
