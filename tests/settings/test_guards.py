"""The launches the port refuses (beam_hpu.settings.guards): one test per rule, each error naming
its culprit."""

from __future__ import annotations

import json
from argparse import Namespace
from types import SimpleNamespace

import pytest

from beam_hpu.settings import guards
from beam_hpu.settings.guards import StartupError, check_startup, startup_problems

RECIPE_ARGS = dict(
    max_model_len=262144,
    enforce_eager=False,
    reasoning_parser="beam",
    tool_call_parser="beam",
    chat_template_content_format="auto",
)


def args(**overrides):
    return Namespace(**{**RECIPE_ARGS, **overrides})


def test_recipe_launch_starts():
    values = check_startup({"BEAM_FSDPA_WS_GIB": "2"}, args(), device_type="hpu")
    assert values["BEAM_FSDPA_WS_GIB"] == 2.0
    # A plain mapping of vLLM's argument names works as well as a Namespace.
    assert check_startup({}, dict(RECIPE_ARGS), device_type="hpu")["BEAM_FSDPA_Q_TILE"] == 256


@pytest.mark.parametrize("value", ["1", "0", ""])
def test_qkv_slice_mode_is_refused_whatever_its_value(value):
    problems = startup_problems({"PT_HPU_SDPA_QKV_SLICE_MODE_FWD": value}, args(), device_type="hpu")
    assert len(problems) == 1 and problems[0].startswith("PT_HPU_SDPA_QKV_SLICE_MODE_FWD is set")
    assert "sliding-window" in problems[0]


@pytest.mark.parametrize("value, refused", [("1", True), ("true", True), ("On", True), ("Y", True),
                                             ("0", False), ("false", False), ("", False), ("2", False)])
def test_merged_prefill_is_refused_when_vllm_gaudi_would_turn_it_on(value, refused):
    # The spellings are vllm-gaudi's (tests/runtime/guards/test_tree_merged_prefill_guard.py reads them off the tree).
    problems = startup_problems({"VLLM_MERGED_PREFILL": value}, args(), device_type="hpu")
    assert bool(problems) == refused, problems
    if refused:
        assert len(problems) == 1 and problems[0].startswith(f"VLLM_MERGED_PREFILL={value}: ")
        assert "sliding windows" in problems[0] and "VLLM_MERGED_PREFILL=0" in problems[0]


@pytest.mark.parametrize(
    "max_model_len, refused",
    [(262144, True), (32768, True), (32767, False), (8192, False), (None, True), (-1, True)],
)
def test_unbounded_fsdpa_workspace_is_refused_at_long_context(max_model_len, refused):
    env = {"BEAM_FSDPA_WS_GIB": "0"}
    problems = startup_problems(env, args(max_model_len=max_model_len), device_type="hpu")
    assert bool(problems) is refused
    if refused:
        assert "BEAM_FSDPA_WS_GIB=0" in problems[0] and "device memory" in problems[0]
    # Any bound at all is accepted at any length.
    assert not startup_problems({"BEAM_FSDPA_WS_GIB": "0.5"}, args(max_model_len=max_model_len), device_type="hpu")


def test_enforce_eager_is_refused_on_hpu_unless_overridden():
    problems = startup_problems({}, args(enforce_eager=True), device_type="hpu")
    assert len(problems) == 1 and "--enforce-eager" in problems[0] and "0.68 tokens/s" in problems[0]
    assert "BEAM_ALLOW_EAGER=1" in problems[0]
    assert not startup_problems({"BEAM_ALLOW_EAGER": "1"}, args(enforce_eager=True), device_type="hpu")
    # The CPU proving ground runs eager: nothing to refuse there.
    assert not startup_problems({}, args(enforce_eager=True), device_type="cpu")


@pytest.mark.parametrize(
    "reasoning, tool, refused",
    [
        ("beam", "beam", False),
        ("beam", None, False),
        ("", "beam", True),  # the tool parser alone would see stripped control tokens
        (None, "beam", True),
        (None, None, False),
        ("deepseek_r1", "hermes", False),  # no beam parser involved: not this port's business
        ("beam", "hermes", True),
        ("qwen3", "beam", True),
    ],
)
def test_beam_parser_is_not_combined_with_another(reasoning, tool, refused):
    problems = startup_problems({}, args(reasoning_parser=reasoning, tool_call_parser=tool), device_type="hpu")
    assert bool(problems) is refused
    if refused and reasoning:
        assert f"--reasoning-parser {reasoning}" in problems[0] and f"--tool-call-parser {tool}" in problems[0]
    elif refused:
        assert "--tool-call-parser beam without --reasoning-parser beam" in problems[0]


def test_openai_content_format_is_refused():
    problems = startup_problems({}, args(chat_template_content_format="openai"), device_type="hpu")
    assert len(problems) == 1 and "--chat-template-content-format openai" in problems[0]
    assert "HTTP 400" in problems[0]
    assert not startup_problems({}, args(chat_template_content_format="string"), device_type="hpu")


def test_check_startup_raises_with_every_culprit():
    env = {"PT_HPU_SDPA_QKV_SLICE_MODE_FWD": "1", "BEAM_FSDPA_WS_GIB": "0", "BEAM_FSDPA_Q_TILE": "3"}
    with pytest.raises(StartupError) as e:
        check_startup(env, args(enforce_eager=True, tool_call_parser="hermes"), device_type="hpu")
    message = str(e.value)
    for culprit in (
        "PT_HPU_SDPA_QKV_SLICE_MODE_FWD",
        "BEAM_FSDPA_Q_TILE",
        "--enforce-eager",
        "--tool-call-parser hermes",
    ):
        assert culprit in message, culprit
    # BEAM_FSDPA_Q_TILE is unreadable, so the switches are unknown: the workspace guard must not
    # guess from a half-read environment.
    assert "BEAM_FSDPA_WS_GIB=0 with" not in message


# ------------------------------------------------------------ which launches are Beam's


def test_beam_launch_is_told_by_parsers_loader_or_checkpoint(tiny_fp32, tmp_path):
    assert guards.is_beam_launch({"reasoning_parser": "beam"})
    assert guards.is_beam_launch({"tool_call_parser": "beam"})
    assert guards.is_beam_launch({"load_format": "beam"})
    assert guards.is_beam_launch({"model": str(tiny_fp32)})  # config.json says model_type beam
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert not guards.is_beam_launch({"model": str(tmp_path)})
    assert not guards.is_beam_launch({"model": "no/such-model-anywhere"})


def test_serve_guard_refuses_only_beam_launches(monkeypatch, tmp_path):
    monkeypatch.delenv("PT_HPU_SDPA_QKV_SLICE_MODE_FWD", raising=False)
    bad = SimpleNamespace(model="x", reasoning_parser="beam", tool_call_parser="hermes",
                          chat_template_content_format="openai", max_model_len=4096)
    with pytest.raises(StartupError) as e:
        guards.guard_serve_args(bad)
    assert "--tool-call-parser hermes" in str(e.value) and "--chat-template-content-format openai" in str(e.value)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    other = SimpleNamespace(model=str(tmp_path), tool_call_parser="hermes", chat_template_content_format="openai")
    guards.guard_serve_args(other)  # not a Beam launch: not ours to refuse


def test_engine_guard_uses_the_resolved_model_type(monkeypatch):
    monkeypatch.setenv("PT_HPU_SDPA_QKV_SLICE_MODE_FWD", "1")
    args = SimpleNamespace(model="some/hub-id", max_model_len=4096)
    beam = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="beam")))
    llama = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="llama")))
    with pytest.raises(StartupError, match="PT_HPU_SDPA_QKV_SLICE_MODE_FWD"):
        guards.guard_engine_config(args, beam)
    guards.guard_engine_config(args, llama)


def test_speculation_on_hpu_serves_sampled_requests_and_names_what_it_cannot_do():
    """Sampled requests are verified on HPU (beam-sampled-verify): the speculative launch starts;
    synthetic acceptance, which no HPU verifier reads, is refused naming the field; CPU is stock."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    assert startup_problems({}, args(speculative_config=ngram), device_type="hpu") == []
    synthetic = {**ngram, "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.5]}
    for config in (synthetic, json.dumps(synthetic)):
        problems = startup_problems({}, args(speculative_config=config), device_type="hpu")
        assert len(problems) == 1 and problems[0].startswith("--speculative-config rejection_sample_method")
    assert startup_problems({}, args(speculative_config=synthetic), device_type="cpu") == []


def test_dflash_is_admitted_only_with_beams_dflash2_drafter(tmp_path):
    """`"method": "dflash"` names its drafter's directory: Beam's DFlash2 drafter starts, another
    architecture or a config that is not on this host is refused naming the field; other methods
    and non-Beam launches are not looked at."""
    def drafter(name, architectures):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": architectures}))
        return str(d)

    beam_draft = drafter("beam", ["DFlash2BeamDraftModel"])
    qwen_draft = drafter("qwen", ["DFlashDraftModel"])
    ok = {"method": "dflash", "model": beam_draft, "num_speculative_tokens": 7}
    assert startup_problems({}, args(speculative_config=ok), device_type="cpu") == []
    assert startup_problems({}, args(speculative_config=json.dumps(ok)), device_type="cpu") == []
    for model, says in ((qwen_draft, "DFlashDraftModel"), (str(tmp_path / "absent"), "not on this host")):
        problems = startup_problems({}, args(speculative_config={**ok, "model": model}), device_type="cpu")
        assert len(problems) == 1 and problems[0].startswith("--speculative-config model") and says in problems[0]
    eagle = {"method": "eagle3", "model": qwen_draft, "num_speculative_tokens": 3}
    assert startup_problems({}, args(speculative_config=eagle), device_type="cpu") == []
    llama = Namespace(model="meta-llama/Llama-3.2-1B", speculative_config={**ok, "model": qwen_draft})
    guards.guard_serve_args(llama)  # not a Beam launch: vLLM's own checks only


def test_dflash_on_hpu_is_admitted_for_beam_with_its_drafter_and_refused_once_per_reason(tmp_path, tiny_fp32):
    """On HPU `dflash` drafts through the port's DFlash2 proposer: Beam's drafter starts; another
    drafter, or one whose config.json is not here, is refused once (rule dflash_drafter, naming
    `--speculative-config model`), not again by speculation_on_hpu; a target whose config.json says
    another model type is refused naming --model; a target not on this host is not guessed at."""
    def checkpoint(name, **config):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        return str(d)

    beam_draft = checkpoint("beam-draft", architectures=["DFlash2BeamDraftModel"])
    ok = {"method": "dflash", "model": beam_draft, "num_speculative_tokens": 7}
    hpu = dict(device_type="hpu")
    assert startup_problems({}, args(speculative_config=ok), **hpu) == []
    assert startup_problems({}, args(model=str(tiny_fp32), speculative_config=json.dumps(ok)), **hpu) == []
    assert startup_problems({}, args(model="reflection/not-on-this-host", speculative_config=ok), **hpu) == []
    other = checkpoint("qwen-draft", architectures=["DFlashDraftModel"])
    for model, says in ((other, "DFlashDraftModel"), (str(tmp_path / "absent"), "not on this host")):
        problems = startup_problems({}, args(speculative_config={**ok, "model": model}), **hpu)
        assert len(problems) == 1, problems
        assert problems[0].startswith(f"--speculative-config model {model!r}") and says in problems[0]
    llama = checkpoint("llama", model_type="llama")
    problems = startup_problems({}, args(model=llama, speculative_config=ok), **hpu)
    assert len(problems) == 1 and problems[0].startswith(f"--model {llama!r} (config.json model_type 'llama')")
    assert "'beam' target only" in problems[0]
    # the target is the HPU proposer's condition: on CPU the rule is the drafter's alone
    assert startup_problems({}, args(model=llama, speculative_config=ok), device_type="cpu") == []
    # a method no HPU runner drafts with is still refused, naming the method
    problems = startup_problems({}, args(speculative_config={"method": "suffix"}), **hpu)
    assert len(problems) == 1 and problems[0].startswith("--speculative-config method 'suffix' on HPU")


def test_dflash_on_hpu_keeps_the_draft_count_its_bucket_file_was_made_for(tmp_path):
    """A bucket file whose header names a draft count (the DFlash2 variant's) refuses method dflash
    at another count on HPU, naming the field, the file and its count; a file that names none, one
    that is not here, and other methods are not looked at."""
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text('{"architectures": ["DFlash2BeamDraftModel"]}')
    made_for_7 = tmp_path / "seven.txt"
    made_for_7.write_text("# buckets\n" + guards.bucket_file_drafts_line(7) + " (why)\n\n(1, 1, [32])\n")
    no_count = tmp_path / "any.txt"
    # a count after the first bucket is not the header's
    no_count.write_text("# buckets\n(1, 1, [32])\n" + guards.bucket_file_drafts_line(7) + "\n")
    assert guards.bucket_file_drafts(made_for_7.read_text()) == 7
    assert guards.bucket_file_drafts(no_count.read_text()) is None

    def problems(k, path, method="dflash", device_type="hpu"):
        config = {"method": method, "model": str(draft), "num_speculative_tokens": k}
        return startup_problems({"VLLM_BUCKETING_FROM_FILE": str(path)}, args(speculative_config=config),
                                device_type=device_type)

    assert problems(7, made_for_7) == []
    refused = problems(3, made_for_7)
    assert len(refused) == 1, refused
    assert refused[0].startswith("--speculative-config num_speculative_tokens 3 with method 'dflash' on HPU")
    assert f"VLLM_BUCKETING_FROM_FILE {made_for_7} is made for 7" in refused[0]
    assert problems(3, no_count) == [] and problems(3, tmp_path / "absent.txt") == []
    assert problems(3, made_for_7, device_type="cpu") == []
    assert problems(3, made_for_7, method="eagle3") == []
