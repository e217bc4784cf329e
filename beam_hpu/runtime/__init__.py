"""Every runtime patch of vLLM the plugin installs, with its index: target, why, how, when it goes.

Runtime patches change vLLM objects in the running process (source edits of the image's trees
are fix units instead: `fixes/units/`, and the port's runner units in each room here). Each one is
a room's `patch_<name>.py`, whose `install()` wraps its targets through `wrap.wrap` (one idempotence guard for all: a mark on the
wrapper), calling plain functions that live in their rooms and have their own tests.
`beam_hpu.register()` calls `install_all()`; `tests/runtime/test_index.py` checks that what a
real `register()` wraps is exactly what this index lists.

The plugin may be installed where other models are served: each entry's `scope` says how the
patch checks that it serves Beam ("beam: ...", mostly through beam_hpu.scope), or why it must act
for every model and which test shows that harmless ("global: ..."). The form is the fix units'
(fixes.unit.scope_problem, checked by tests/runtime/test_index.py), and tests/runtime/test_scope.py
runs non-Beam models with the plugin on and off.

Registrations through vLLM's own registries (model, `--load-format beam`, parsers) are not
patches and are not listed here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimePatch:
    name: str
    module: str  # beam_hpu.runtime.<module>, whose install() applies it
    targets: tuple[str, ...]  # what it wraps, "module.Class.attr"
    platform: str  # "any", or the only platform it is installed on ("cpu")
    # Which models it acts for: "beam: <how it checks it serves Beam>" or
    # "global: <why it must act for every model, and the test that shows it harmless>".
    scope: str
    why: str
    how: str
    remove_when: str
    upstream: str


INDEX: tuple[RuntimePatch, ...] = (
    RuntimePatch(
        name="startup-guard",
        module="guards.patch_startup_guard",
        targets=("vllm.entrypoints.cli.serve.ServeSubcommand.validate",
                 "vllm.engine.arg_utils.EngineArgs.create_engine_config"),
        platform="any",
        scope="beam: refuses only a Beam launch: guard_serve_args / guard_engine_config check "
              "nothing unless is_beam_launch (config.json model_type beam, --load-format beam or a "
              "beam parser) or the resolved hf_config.model_type is beam "
              "(beam_hpu.settings.guards); tests/runtime/test_scope.py starts a Llama and a "
              "Qwen3-MoE with the plugin on",
        why="vLLM 0.30.0 gives a general plugin no hook with the parsed arguments, and the port must "
            "refuse launches it cannot serve (beam_hpu.settings.guards) before anything starts.",
        how="Calls guard_serve_args / guard_engine_config before `vllm serve` validates its "
            "arguments and after an engine resolves its config; only on modules already imported.",
        remove_when="vLLM offers plugins a validation hook on the parsed arguments.",
        upstream="none filed",
    ),
    RuntimePatch(
        name="fp8-checkpoint-check",
        module="guards.patch_fp8_checkpoint_check",
        targets=("vllm.model_executor.model_loader.base_loader.BaseModelLoader.load_model",),
        platform="any",
        scope="beam: check_before_load returns at once unless the hf_config architectures name "
              "BeamForCausalLM and the quantization is compressed-tensors "
              "(beam_hpu.quant.checkpoint_check); tests/runtime/test_scope.py loads an FP8 Llama "
              "with the plugin on",
        why="vLLM checks that every parameter was loaded only for unquantised models: a missing FP8 "
            "weight_scale serves garbage, a misshapen one fails without the tensor's name.",
        how="Runs beam_hpu.quant.checkpoint_check.check_before_load (headers only) for compressed-"
            "tensors Beam checkpoints before the model is built; not under the dummy loader, which "
            "reads no checkpoint (card-check's synthetic Beam).",
        remove_when="vLLM's loaders track quantised parameters too (DefaultModelLoader.track_weights_loading).",
        upstream="none filed",
    ),
    RuntimePatch(
        name="untrusted-text",
        module="guards.patch_untrusted_text",
        targets=("vllm.renderers.hf.safe_apply_chat_template",
                 "vllm.entrypoints.pooling.scoring.io_processor.safe_apply_chat_template"),
        platform="any",
        scope="beam: render_untrusted calls vLLM's function unchanged unless the tokenizer carries "
              "Beam's response template (beam_hpu.parsers.untrusted.beam_added_tokens): keyed on the "
              "tokenizer, whose control tokens are what it protects, so a Beam tokenizer is "
              "protected under any --model (tests/parsers/test_untrusted.py::"
              "test_other_tokenizers_are_left_alone: a tokenizer without it renders as vLLM does)",
        why="vLLM renders the chat template to text and tokenizes it with special tokens on, so a "
            "client string holding `<|end|><|start|>` becomes real control tokens (forged turns).",
        how="For tokenizers with a response template, renders with client text neutralised and "
            "encodes every segment between the template's control tokens as plain text "
            "(beam_hpu.parsers.untrusted); the second target only where that module is imported.",
        remove_when="vLLM tokenizes chat-template output with client text kept apart from special tokens.",
        upstream="none filed",
    ),
    RuntimePatch(
        name="portable-fp8-moe",
        module="fp8.patch_portable_moe",
        targets=("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
                 "compressed_tensors_moe.CompressedTensorsMoEMethod.get_moe_method",),
        platform="any",
        scope="beam: portable_replacement takes a layer only while vLLM builds a Beam model "
              "(beam_hpu.scope.building_beam: the current VllmConfig's model_type); another "
              "compressed-tensors FP8 MoE, shared experts or not, keeps vLLM's method and is "
              "refused at load as without the plugin (tests/runtime/test_scope.py)",
        why="On CPU vLLM has no FP8 MoE backend for per-channel weights with per-token activations "
            "(`Unsupported FP8 MoE backend: NONE`); on HPU vllm-gaudi's own method is chosen first.",
        how="Where vLLM's W8A8 FP8 method found backend NONE for the published scheme in a Beam model, returns "
            "beam_hpu.runtime.fp8.portable_moe.PortableFp8MoEMethod instead.",
        remove_when="vLLM-CPU ships an FP8 MoE kernel for channel weights and dynamic per-token activations.",
        upstream="none filed",
    ),
    RuntimePatch(
        name="cpu-fp8-dense-rounding",
        module="fp8.patch_cpu_dense_rounding",
        targets=("vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel."
                 "FP8ScaledMMLinearKernel.__init__",),
        platform="cpu",
        scope="beam: the kernel's quant_fp8 is replaced only while vLLM builds a Beam model "
              "(beam_hpu.scope.building_beam); another model's FP8 linears keep QuantFP8 "
              "(tests/runtime/test_scope.py: an FP8 Llama's kernels and greedy tokens as with "
              "plugins off)",
        why="vLLM-CPU's FP8 linears round activations with QuantFP8 (x * (1 / scale), no 1e-8): "
            "neither rounding BEAM_EXACT_ROUNDING names, so served dense layers and the reference "
            "would round differently from the experts and from each other.",
        how="After the kernel's own __init__, a Beam model's dynamic per-token kernel's quant_fp8 becomes "
            "beam_hpu.runtime.fp8.cpu_dense_rounding.dense_activation_quantiser() (the switch's rounding).",
        remove_when="The CPU path no longer serves as the stand-in for the device's FP8 rounding.",
        upstream="not an upstream bug: a port choice",
    ),
    RuntimePatch(
        name="cpu-expert-parallel",
        module="expert_parallel.patch_cpu_expert_parallel",
        targets=("vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts.apply",),
        platform="cpu",
        scope="global: a bug fix of vLLM-CPU's unquantised experts, whose layer gives apply() no "
              "model to ask; without an expert_map (no --enable-expert-parallel) it calls vLLM's "
              "apply with the same arguments (tests/runtime/test_scope.py: a Qwen3-MoE's greedy "
              "tokens equal plugins off), and with one stock reads wrong experts or out of bounds "
              "(tests/runtime/expert_parallel/test_cpu_expert_parallel_engine.py)",
        why="CPUUnquantizedExperts.apply never passes expert_map to cpu_fused_moe, which then indexes "
            "local weights with global expert ids (wrong experts, out-of-bounds reads).",
        how="Maps global top-k ids to local ones (beam_hpu.runtime.expert_parallel.cpu_expert_parallel.remap_topk_to_local) "
            "when an expert_map is given; other ranks' slots get weight 0.",
        remove_when="vLLM's CPU unquantised experts honour expert_map.",
        upstream="none filed",
    ),
    RuntimePatch(
        name="prefill-inflight",
        module="prefill.patch_inflight",
        targets=("vllm.v1.core.sched.scheduler.Scheduler.schedule",),
        platform="any",
        scope="beam: reorders only when serves_beam(scheduler.vllm_config) (beam_hpu.scope: "
              "hf_config.model_type beam) and BEAM_PREFILL_INFLIGHT=1; tests/runtime/test_scope.py: "
              "a Llama scheduler's steps with the switch at 1 equal plugins off",
        why="vLLM's scheduler serves its running requests in admission order and preempts from the "
            "end: a prompt admitted before some decodes takes the step's token budget from them and "
            "evicts them to grow (BEAM_PREFILL_INFLIGHT, beam_hpu.runtime.prefill.inflight).",
        how="For an engine serving Beam with BEAM_PREFILL_INFLIGHT=1, reorders Scheduler.running "
            "decodes first (each group in its order) before the stock schedule() runs; otherwise "
            "calls it unchanged.",
        remove_when="vLLM's scheduler gives running decodes precedence over prefill chunks.",
        upstream="none filed",
    ),
    RuntimePatch(
        name="cpu-rejection-sampler",
        module="speculative.patch_cpu_rejection_sampler",
        targets=("vllm.v1.sample.rejection_sampler.rejection_sample",
                 "vllm.v1.sample.rejection_sampler.expand_batch_to_tokens"),
        platform="cpu",
        scope="global: the stock functions cannot run on vLLM-CPU at all (Triton, first verify step "
              "dies) for any model; the replacement implements speculative sampling's definition, "
              "checked against it and through vLLM's own RejectionSampler in "
              "tests/runtime/speculative/test_rejection_sampling.py",
        why="vLLM 0.30.0's rejection sampler launches its Triton kernels through JIT-warmup "
            "dispatchers that keep the kernels themselves; vLLM-CPU swaps only the module-level "
            "kernel names, so the first speculative verify step dies (no Triton CPU backend).",
        how="Replaces both functions by beam_hpu.runtime.speculative.rejection_sampling.verify / expand_per_request "
            "(plain torch: greedy, random and synthetic acceptance, recovered tokens); the uniforms "
            "are still vLLM's generate_uniform_probs.",
        remove_when="vLLM-CPU's runner swaps the dispatchers' kernels (`_rejection_greedy_sample.kernel` "
                    "etc.) or the sampler has a torch path on CPU.",
        upstream="none filed",
    ),
    RuntimePatch(
        name="hpu-speculative-sampling-limits",
        module="speculative.patch_hpu_sampling_limits",
        targets=("vllm.sampling_params.SamplingParams.verify",),
        platform="hpu",
        scope="beam: request_refusal acts only when the engine's model config has hf_config.model_type "
              "beam, on HPU, with --speculative-config; any other request passes unchanged",
        why="The Gaudi verify step (port unit beam-sampled-verify) serves greedy and random sampling "
            "with temperature, top-k/top-p and seeds, but not penalties, bad words, allowed token ids, "
            "min_tokens or logprobs: such a request would stop the engine or be served wrong.",
        how="After the stock checks, refuses such a request with VLLMValidationError (HTTP 400) naming "
            "the field (beam_hpu.runtime.speculative.hpu_sampled_verify.request_refusal).",
        remove_when="vllm-gaudi's verify step applies penalties, bad words, allowed tokens and min_tokens "
                    "to drafts' targets and returns their logprobs.",
        upstream="none filed",
    ),
    RuntimePatch(
        name="cpu-eagle-step",
        module="speculative.patch_cpu_eagle_step",
        targets=("vllm.v1.spec_decode.llm_base_proposer.eagle_step_update_slot_mapping_and_metadata",),
        platform="cpu",
        scope="global: the stock dispatcher cannot run on vLLM-CPU for any EAGLE drafter (second "
              "drafting step dies); the replacement computes what the Triton kernel computes, "
              "checked against its definition and vLLM-CPU's own C++ op in tests/runtime/speculative/test_cpu_eagle_step.py",
        why="vLLM 0.30.0's EAGLE proposer advances each drafting step through the JIT-warmup Triton "
            "dispatcher `_eagle_step_slot_mapping_metadata`; vLLM-CPU swaps the kernel of the other "
            "EAGLE dispatchers but only the module-level name of this one, so the second drafting "
            "step of an EAGLE/EAGLE3 drafter kills the engine.",
        how="Replaces the proposer's binding by beam_hpu.runtime.speculative.cpu_eagle_step.advance_one_position (plain "
            "torch: next position, its KV slot, seq_lens + 1, padding slots), with vLLM's PADDING_SLOT_ID.",
        remove_when="vLLM-CPU's runner sets `_eagle_step_slot_mapping_metadata.kernel` to its CPU op.",
        upstream="none filed",
    ),
    RuntimePatch(
        name="cpu-dflash2-proposer",
        module="speculative.patch_cpu_dflash2_proposer",
        targets=("vllm.v1.worker.gpu_model_runner.GPUModelRunner.__init__",),
        platform="cpu",
        scope="beam: replaces the drafter only when serves_beam_dflash2(vllm_config) (beam_hpu.scope: "
              "hf_config.model_type beam, method dflash, drafter architectures DFlash2BeamDraftModel); "
              "any other runner keeps the drafter vLLM built",
        why="vLLM 0.30.0 runs DFlash2 only in its V2 GPU runner; its V1 runner (vLLM-CPU's) builds "
            "DFlash v1's proposer for method dflash, which never runs the candidate selector and "
            "writes context K/V through a Triton kernel vLLM-CPU cannot launch.",
        how="After the stock __init__, a Beam runner with a DFlash2 Beam drafter gets "
            "beam_hpu.runtime.speculative.cpu_dflash2_proposer.CpuDFlash2Proposer (a DFlashProposer "
            "to the runner: per-request context K/V from the target's aux states, one block forward, "
            "the selector's greedy walk, plain torch).",
        remove_when="vLLM's V1 runner (or vLLM-CPU's V2 runner) drafts DFlash2 with a Beam drafter.",
        upstream="none filed",
    ),
)


def applies_here(patch: RuntimePatch, platform: str) -> bool:
    return patch.platform in ("any", platform)


def install_all() -> None:
    """Install every patch of the index that applies to this platform. Idempotent."""
    from vllm.platforms import current_platform

    platform = "cpu" if current_platform.is_cpu() else str(current_platform.device_type)
    for patch in INDEX:
        if applies_here(patch, platform):
            importlib.import_module(f"beam_hpu.runtime.{patch.module}").install()
