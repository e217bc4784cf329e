"""--speculative-config keys Beam's DFlash2 path does not read are refused at startup, naming the
key (rule dflash2_options, table beam_hpu/settings/speculative_options.py); the keys it honours, and
every key at its default, still start. The rule runs as the port runs it (startup_problems /
check_startup on vLLM's argument names); the table is checked against the installed vLLM's
SpeculativeConfig, so a key vLLM adds fails here until it is classified."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest

from beam_hpu.settings import speculative_options as so
from beam_hpu.settings.guards import StartupError, check_startup, startup_problems
from beam_hpu.tiny.checkpoint import TRAINED_DIR
from beam_hpu.tiny.dflash2_drafter import DFLASH2_DIR

BEAM = dict(model=str(TRAINED_DIR), max_model_len=4096, reasoning_parser="beam", tool_call_parser="beam")
DFLASH2 = {"method": "dflash", "model": str(DFLASH2_DIR), "num_speculative_tokens": 7}
# A value other than what the path does, for each key the table refuses somewhere.
UNREAD = {
    "rejection_sample_method": "block", "quantization": "fp8",
    "moe_backend": "triton", "attention_backend": "FLASH_ATTN", "kv_cache_dtype": "fp8",
    "draft_tensor_parallel_size": 2, "use_local_argmax_reduction": True, "enable_adaptive_verification": True,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2, "suffix_decoding_max_tree_depth": 12,
    "suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 2.0,
    "suffix_decoding_min_token_prob": 0.5, "enforce_eager": True, "max_model_len": 2048,
    "disable_padded_drafter_batch": True, "num_speculative_tokens_per_batch_size": [[1, 4, 7], [5, 16, 3]],
}


def problems(device, speculative_config, **launch):
    return startup_problems({}, Namespace(**{**BEAM, **launch, "speculative_config": speculative_config}),
                            device_type=device)


def ours(found):
    return [p for p in found if "with Beam's DFlash2 drafter" in p]


@pytest.mark.parametrize("device", ["cpu", "hpu"])
def test_probabilistic_drafting_is_served_on_both_devices(device):
    """Both proposers sample the walk (tests/runtime/speculative/test_dflash2_sampled_walk.py)."""
    for config in ({**DFLASH2, "draft_sample_method": "probabilistic"},
                   json.dumps({**DFLASH2, "draft_sample_method": "greedy"}),
                   {**DFLASH2, "draft-sample-method": "probabilistic"}):  # vLLM reads a dash as an underscore
        assert problems(device, config) == []


@pytest.mark.parametrize("device", ["cpu", "hpu"])
def test_block_verification_is_refused_and_synthetic_left_where_it_is_read(device):
    found = problems(device, {**DFLASH2, "rejection_sample_method": "block"})
    assert len(found) == 1 and found[0].startswith("--speculative-config rejection_sample_method 'block'")
    synthetic = {**DFLASH2, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 3.0}
    # CPU verifies synthetic acceptance (cpu-rejection-sampler); on HPU rule speculation_on_hpu refuses it, once
    assert ours(problems(device, synthetic)) == []
    assert len(problems(device, synthetic)) == (0 if device == "cpu" else 1)


@pytest.mark.parametrize("device", ["cpu", "hpu"])
def test_drafter_build_options_it_does_not_read_are_refused(device):
    """Quantisation, MoE and attention backends, a KV-cache dtype and a draft TP size other than the
    target's: the drafter is built without them. Their 'nothing asked' spellings start."""
    for key in ("quantization", "moe_backend", "attention_backend", "kv_cache_dtype", "draft_tensor_parallel_size"):
        found = problems(device, {**DFLASH2, key: UNREAD[key]})
        assert len(found) == 1 and found[0].startswith(f"--speculative-config {key} {UNREAD[key]!r} with"), found
    fine = {**DFLASH2, "attention_backend": "auto", "kv_cache_dtype": "auto", "draft_tensor_parallel_size": 1}
    assert problems(device, fine) == []
    assert problems(device, {**DFLASH2, "draft_tensor_parallel_size": 2}, tensor_parallel_size=2) == []
    found = problems(device, {**DFLASH2, "draft_tensor_parallel_size": 1}, tensor_parallel_size=2)
    assert len(found) == 1 and "supported: the target's --tensor-parallel-size" in found[0]


@pytest.mark.parametrize("device", ["cpu", "hpu"])
def test_other_methods_options_are_refused(device):
    """ngram's and suffix decoding's options, EAGLE's local argmax, DSpark's adaptive verification."""
    keys = ("prompt_lookup_max", "prompt_lookup_min", "suffix_decoding_max_tree_depth",
            "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
            "suffix_decoding_min_token_prob", "use_local_argmax_reduction", "enable_adaptive_verification")
    found = problems(device, {**DFLASH2, **{key: UNREAD[key] for key in keys}})
    assert [p.split()[1] for p in found] == list(keys)
    # at vLLM's defaults they ask for nothing
    assert problems(device, {**DFLASH2, "suffix_decoding_max_tree_depth": 24, "use_local_argmax_reduction": False,
                             "suffix_decoding_min_token_prob": 0.1, "enable_adaptive_verification": False}) == []


def test_what_vllms_runner_reads_on_cpu_is_refused_on_hpu_only():
    """vLLM's V1 runner (CPU) reads these for the DFlash2 proposer; vllm-gaudi's runner does not."""
    keys = ("enforce_eager", "max_model_len", "disable_padded_drafter_batch", "num_speculative_tokens_per_batch_size")
    config = {**DFLASH2, **{key: UNREAD[key] for key in keys}}
    assert problems("cpu", config) == []
    found = problems("hpu", config)
    assert [p.split()[1] for p in found] == list(keys)
    assert all(f"with Beam's DFlash2 drafter on HPU: " in p for p in found)


@pytest.mark.parametrize("device", ["cpu", "hpu"])
def test_every_refused_key_is_named_and_every_honoured_one_starts(device):
    """Each key of the table, set to a value the path does not serve, is refused alone and by name
    where the table says; the honoured keys, set away from their defaults, start."""
    options = so.options_by_key()
    assert set(UNREAD) == set(options)
    for key, value in UNREAD.items():
        found = problems(device, {**DFLASH2, key: value})
        if device in options[key].refused_on:
            assert len(found) == 1 and found[0].startswith(f"--speculative-config {key} {value!r} with "), (key, found)
            assert f"supported: {options[key].supported}" in found[0]
        else:
            assert found == [], (key, found)
    honoured = {**DFLASH2, "num_speculative_tokens": 3, "revision": "main", "code_revision": "main",
                "disable_eagle_block_drop": True, "parallel_drafting": True}
    assert problems(device, honoured) == []


def test_only_beams_dflash2_drafter_on_a_beam_target_is_looked_at(tmp_path):
    """Another drafter is rule dflash_drafter's (refused once, by it); another method, or a target
    whose config.json names another model type, is not this rule's."""
    other = tmp_path / "other-draft"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    found = problems("cpu", {**DFLASH2, "model": str(other), "draft_sample_method": "probabilistic"})
    assert len(found) == 1 and found[0].startswith("--speculative-config model")
    eagle = {"method": "eagle3", "model": str(other), "num_speculative_tokens": 3,
             "draft_sample_method": "probabilistic"}
    assert problems("cpu", eagle) == []
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert ours(problems("cpu", {**DFLASH2, "draft_sample_method": "probabilistic"}, model=str(llama))) == []


def test_the_table_covers_every_key_of_the_installed_vllm():
    """Every field of vLLM's SpeculativeConfig sits in exactly one group, and the table's defaults
    are vLLM's: a key vLLM adds, or a default it changes, fails here until the table says what the
    DFlash2 path does with it."""
    from vllm.config.speculative import SpeculativeConfig

    fields = SpeculativeConfig.__pydantic_fields__
    groups = [set(so.HONOURED), set(so.options_by_key()), set(so.VLLM_REFUSES), set(so.ENGINE_SET)]
    assert sum(len(g) for g in groups) == len(set().union(*groups)), "a key sits in two groups"
    assert set().union(*groups) == set(fields)
    for option in so.OPTIONS:
        assert fields[option.key].get_default(call_default_factory=True) == option.default, option.key


def test_the_shorthand_speculative_flags_are_guarded_as_the_config_they_make():
    """vLLM merges --spec-method, --spec-model and --spec-tokens into --speculative-config; the guards
    read the merged config, so the flags cannot carry a launch past them."""
    flags = dict(spec_method="dflash", spec_model=str(DFLASH2_DIR), spec_tokens=7)
    assert problems("hpu", None, **flags) == []
    assert problems("cpu", {"enforce_eager": True}, **flags) == []  # read on CPU, not on HPU
    found = problems("hpu", {"enforce_eager": True}, **flags)
    assert [p.split(":")[0] for p in found] == ["--speculative-config enforce_eager True with "
                                                "Beam's DFlash2 drafter on HPU"], found
    other = problems("cpu", None, spec_method="dflash", spec_model=str(TRAINED_DIR))
    assert len(other) == 1 and "method 'dflash' serves only Beam's DFlash2 drafter" in other[0], other
