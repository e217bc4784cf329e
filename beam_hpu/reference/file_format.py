"""The reference file the perplexity gate reads (`beam-gates-reference/1`): its one definition.

Written by the in-memory reference (`live.live_reference`, CPU, checkpoints a host can hold) and by
the streamed one (`streamed.write_streamed_reference`, `beam-hpu reference`, the 501B model); read
by `beam_hpu.gates.perplexity`.

JSON:
  {"format": "beam-gates-reference/1", "model": str, "reference": str (how it was computed),
   "topk": int, "gates": {"ppl_rel": float, "kl": float, "top1_margin": float},
   "passages": [{"name": str, "token_ids": [int], "token_logprobs": [null, float...],
                 "top1": [null, int...], "topk": [null, [[int, float], ...]...], "floor_top1": float}]}
  Position i holds log p(token i | tokens < i) and the reference's top-k at i (null at 0).
  Optional per passage: "scored": [0|1, ...] (one per token, 0 at position 0): the positions the
  gates count; absent = every position from 1. The stored references for the 501B model score
  every position of natural text. The tiny trained Beam (CPU profile) is scored where it was
  trained to predict: the repeat of a copy passage, the assistant turns of a conversation. Its
  other positions (random filler, prompts) were never trained, its outputs there are arbitrary, and
  FP8 activation rounding makes them chaotic: there the reference moves by several times the bars
  between bf16 and fp32, on the scored positions by a fraction of them
  (benchmarks/fp8_perplexity_noise_floor.py prints both; beam_hpu/gates/README.md, "Calibration").
  "floor_top1": the top-1 agreement a second model reaches against the reference on the scored
  positions (FP8: transformers' Beam with the weights dequantised; unquantised: the other precision).
"""

from __future__ import annotations

FORMAT = "beam-gates-reference/1"


def scored_positions(ref: dict) -> list[int]:
    """The positions of a passage document the gates count."""
    scored = ref.get("scored")
    return [i for i in range(1, len(ref["token_ids"])) if scored is None or scored[i]]


def check_scored(name: str, ids: list[int], scored) -> None:
    if len(scored) != len(ids) or scored[0] or not any(scored):
        raise ValueError(f"passage {name}: 'scored' needs one flag per token, none at position 0 and "
                         f"at least one set")


def gates_of(profile) -> dict:
    """The bars a reference file carries, from a gate profile (`beam_hpu.gates.profile.Profile`)."""
    return {"ppl_rel": profile.ppl_rel_gate, "kl": profile.kl_gate, "top1_margin": profile.top1_margin}
