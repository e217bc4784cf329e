"""Stress: M streaming decodes while a long prompt prefills; all complete, server healthy after."""

from __future__ import annotations

import threading
import time

from beam_hpu.gates.common import Filler
from beam_hpu.gates.result import GateResult


def run(ep, profile, **_) -> GateResult:
    filler = Filler(ep, profile.pieces(), profile.seed + 61)
    m, n = profile.stress_streams, profile.stress_decode_tokens
    prompts = [filler.ids(32) for _ in range(m)]
    long_prompt = filler.ids(profile.stress_prompt_tokens)
    got, errors = [0] * m, []

    def stream(i):
        try:
            for chunk in ep.client.completions.create(model=ep.model, prompt=prompts[i], max_tokens=n, temperature=0.0,
                                                      stream=True, extra_body={"ignore_eos": True,
                                                                               "return_token_ids": True}):
                for c in chunk.choices:
                    got[i] += len((c.model_extra or {}).get("token_ids") or [])
        except Exception as e:  # noqa: BLE001 - every failure is a gate result
            errors.append(f"stream {i}: {e!r}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(m)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # decodes running, then the long prefill joins
    t0 = time.time()
    try:
        long_out = ep.complete_ids(long_prompt, 1)
        long_ok = len(long_out["token_ids"]) == 1
    except Exception as e:  # noqa: BLE001
        long_ok = False
        errors.append(f"long prompt: {e!r}")
    prefill_s = time.time() - t0
    for t in threads:
        t.join()
    complete = sum(g == n for g in got)
    healthy = ep.healthy()
    passed = complete == m and long_ok and healthy and not errors
    # What went wrong goes into the one line a failing run prints (the details may be cut off).
    short = "".join(f"; stream {i}: {g} of {n} tokens" for i, g in enumerate(got) if g != n)
    return GateResult("stress", passed,
                      f"{m} streaming decodes of {n} tokens while a {len(long_prompt):,}-token prompt prefills: "
                      f"{complete}/{m} complete, long prompt {'done' if long_ok else 'FAILED'} in {prefill_s:.1f} s, "
                      f"server {'healthy' if healthy else 'UNHEALTHY'}{short}"
                      + "".join(f"; {e}" for e in errors), {"tokens": got, "errors": errors})
