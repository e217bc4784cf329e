"""Issue 16 item 1, suffix decoding: lossless like ngram (tests/e2e/test_spec_ngram.py, same
requests, same checks), where arctic-inference is installed (skipped otherwise).

vLLM 0.30.0's `suffix` method needs only arctic-inference's suffix tree (`arctic_inference.
suffix_decoding`, a C++ extension with no CUDA code); PyPI has only the 0.3.0 sdist, which builds
on CPU once CMake can find nanobind: `CMAKE_PREFIX_PATH=$(python -m nanobind --cmake_dir) pip
install --no-build-isolation arctic-inference==0.3.0` (its build needs setuptools, ninja, cmake,
nanobind==2.9.2, grpcio-tools and torch). Its vLLM plugin stays off unless
ARCTIC_INFERENCE_ENABLED is set (and then requires CUDA); suffix decoding does not need it.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("arctic_inference.suffix_decoding", reason="arctic-inference is not installed")

from tests.e2e.test_spec_ngram import SPLIT, first_difference, serve_and_answer  # noqa: E402

pytestmark = pytest.mark.slow
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}


@pytest.fixture(scope="module")
def runs():
    return serve_and_answer([]), serve_and_answer(["--speculative-config", json.dumps(SUFFIX)])


def test_suffix_drafted_and_accepted(runs):
    c = runs[1]["counters"]
    assert c["num_drafts"] > 0 and c["num_accepted_tokens"] > 0, c
    print(f"suffix: mean accepted length {1 + c['num_accepted_tokens'] / c['num_drafts']:.2f}")


def test_every_answer_is_identical_with_and_without_suffix(runs):
    plain, spec = runs
    assert len(plain["answers"]) == len(spec["answers"]) >= 19
    for a, b in zip(plain["answers"], spec["answers"]):
        if "token_ids" in a:
            assert b["token_ids"] == a["token_ids"], (a["kind"], first_difference(a["token_ids"], b["token_ids"]))
        if a["kind"] != "completion":
            assert {k: b[k] for k in SPLIT} == {k: a[k] for k in SPLIT}
    assert spec["grammar"]["token_ids"] == plain["grammar"]["token_ids"]
    assert json.loads(spec["grammar"]["content"]) == {"city": "Lima"}
    assert all(spec["gates"][n].result == r.result for n, r in plain["gates"].items())


def test_seeded_random_sampling_runs_under_suffix(runs):
    """Sampled requests verify through the CPU rejection sampler's random path. Unlike ngram, a
    repeat of a seeded request need not repeat its text: suffix decoding drafts from earlier
    responses too (its global tree), so the second run gets other drafts, which draw the seeded
    uniforms differently (lossless in distribution, not sample for sample)."""
    assert all(text for text in runs[1]["random"])
