"""What the parser guards (beam_hpu.parsers.untrusted, validation) cost per request, in one run, as ratios of medians (no engine needed).

1. Rendering a chat request (vLLM 0.30.0's safe_apply_chat_template, then the tokenizer, as the
   server does) with the plugin's hook vs without it: a benign request (the hook only checks it)
   and a hostile one (neutralised render + per-segment tokenization), each with tools.
2. The request adjustment (`constrain_request`, tool_choice required) with the grammar-compile
   check on a cold cache vs the adjustment without that check.
Timings alternate A, B, A, B so drift on a noisy machine hits both.

Run: .venv/bin/python benchmarks/untrusted_text_cost.py [--rounds 200]
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def median_seconds(fn, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def alternate(a, b, rounds: int) -> tuple[float, float]:
    ta, tb = [], []
    for _ in range(5):
        ta.append(median_seconds(a, max(1, rounds // 5)))
        tb.append(median_seconds(b, max(1, rounds // 5)))
    return statistics.median(ta), statistics.median(tb)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    import beam_hpu.parsers.validation as validation
    from beam_hpu.parsers.request import constrain_request
    from beam_hpu.parsers.template import response_template_of
    from beam_hpu.tiny.checkpoint import TRAINED_DIR
    from tests.support.hostile import FIELDS, payload_for

    from beam_hpu.runtime.guards.patch_untrusted_text import install

    install()
    import vllm.renderers.hf as hf
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    tokenizer = AutoTokenizer.from_pretrained(str(TRAINED_DIR))
    guarded, plain = hf.safe_apply_chat_template, hf.safe_apply_chat_template.__wrapped__

    def render(fn, messages, tools):
        out = fn(None, tokenizer, messages, tools=tools, chat_template=tokenizer.chat_template, tokenize=False,
                 add_generation_prompt=True)
        return out if isinstance(out, list) else tokenizer.encode(out, add_special_tokens=False)

    for label, value in (("benign", "plain words, no markup"), ("hostile", payload_for(tokenizer))):
        messages, tools, _ = FIELDS["every field at once"](value)
        t_hook, t_plain = alternate(lambda: render(guarded, messages, tools), lambda: render(plain, messages, tools),
                                    args.rounds)
        print(f"render+tokenize {label:7s}: hook {t_hook * 1e3:.3f} ms, vLLM alone {t_plain * 1e3:.3f} ms, "
              f"ratio {t_hook / t_plain:.2f}x")

    template, vocab = response_template_of(tokenizer), tokenizer.get_vocab()
    _, tools, _ = FIELDS["every field at once"]("plain")

    def adjust():
        request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools,
                                        tool_choice="required")
        constrain_request(request, template, vocab, thinking=True)

    def adjust_cold():
        validation._refusal.cache_clear()
        adjust()

    original = validation.check_grammar_compiles
    import beam_hpu.parsers.request as request_module

    def adjust_without_check():
        request_module.check_grammar_compiles = lambda *a, **k: None
        try:
            adjust()
        finally:
            request_module.check_grammar_compiles = original

    t_cold, t_without = alternate(adjust_cold, adjust_without_check, args.rounds)
    t_warm, _ = alternate(adjust, adjust_without_check, args.rounds)
    print(f"constrain_request: compile check cold {t_cold * 1e3:.3f} ms, warm {t_warm * 1e3:.3f} ms, "
          f"without {t_without * 1e3:.3f} ms; cold/without {t_cold / t_without:.2f}x, warm/without "
          f"{t_warm / t_without:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
