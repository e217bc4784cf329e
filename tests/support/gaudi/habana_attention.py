"""Stand-ins for what vllm-gaudi's HPUAttentionImpl reaches on a card and CPU torch cannot run:
Habana's FusedSDPA (prompt attention, through ModuleFusedSDPA) after the bridge's public source
(HabanaAI/gaudi-pytorch-bridge), and the card's matmul into an out tensor of another dtype (the
decode path's fp32-softmax scores). Written here, not from the code under test; our model of the
card all the same: nothing here ran on one.

FusedSDPA:

Signature and contract: python_packages/habana_frameworks/torch/hpex/kernels/FusedSDPA.py,
`FusedSDPA.forward` / `sdpa_fwd_wrapper`: q, k, v as [B, heads, S, D]; an attention mask of
rank 2 (expanded over the batch) or 4, added to the scaled scores (a bool mask keeps True);
`is_causal` a triangular mask; `scale` 1/sqrt(D) when None; grouped-query attention when the
key heads divide the query heads (`is_gqa`, `gqa_input_reshape_fwd`: query head h reads key
group h // (query heads / key heads)); softmax_mode "fp32" only for bf16 inputs; inference runs
the recompute variant (hpu::sdpa_recomp_fwd), whose output has q's sizes with v's last dim.
Arithmetic: the card test's reference (tests/pytest_working/any_mode/FusedSDPA/test_hpu_sdpa.py,
`vanilla_attention_impl_for_test`): softmax(q @ k^T * scale + mask) @ v, taken here in fp32 (the
fp32 softmax mode's accumulation), then cast to q's dtype.

What this stand-in does not model is refused, loudly: dropout, returned masks or probabilities,
sinks, a kernel-side window (window_size other than (-1, -1)), softmax modes other than fp32,
and valid_seq_len with left padding. valid_seq_len with right padding (the only side vllm-gaudi
passes) masks the keys at or past each sequence's valid length.
"""
from __future__ import annotations

import torch


class FusedSDPA:
    """hpex.kernels.FusedSDPA, inference forward only, after the bridge's
    python_packages/habana_frameworks/torch/hpex/kernels/FusedSDPA.py and the card test's reference
    (tests/pytest_working/any_mode/FusedSDPA/test_hpu_sdpa.py), as the module says; `calls` records
    every call's shapes and mode (class-wide: vllm-gaudi holds the class, not an instance)."""

    calls: list[dict] = []

    @staticmethod
    def apply(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, softmax_mode="None",
              recompute_mode=None, valid_seq_len=None, seq_padding_type="left", return_dropout_mask=False,
              return_attn_probs=False, window_size=(-1, -1), sink=None):
        if dropout_p != 0.0 or return_dropout_mask or return_attn_probs or sink is not None:
            raise NotImplementedError("FusedSDPA stand-in: no dropout, returned masks/probabilities or sinks")
        if tuple(window_size) != (-1, -1):
            raise NotImplementedError(f"FusedSDPA stand-in: kernel window {window_size} not modelled")
        if softmax_mode.lower() != "fp32" or q.dtype != torch.bfloat16:
            raise NotImplementedError(f"FusedSDPA stand-in: softmax_mode {softmax_mode!r} on {q.dtype} not modelled")
        if valid_seq_len is not None and seq_padding_type.lower() != "right":
            raise NotImplementedError("FusedSDPA stand-in: valid_seq_len with left padding not modelled")
        FusedSDPA.calls.append({"q": tuple(q.shape), "k": tuple(k.shape), "is_causal": bool(is_causal),
                                "mask": None if attn_mask is None else tuple(attn_mask.shape),
                                "valid_seq_len": None if valid_seq_len is None else valid_seq_len.tolist()})
        q_heads, kv_heads = q.shape[1], k.shape[1]
        if q_heads % kv_heads:
            raise ValueError(f"FusedSDPA: {kv_heads} key heads for {q_heads} query heads")
        qf = q.float()
        kf = k.float().repeat_interleave(q_heads // kv_heads, dim=1)
        vf = v.float().repeat_interleave(q_heads // kv_heads, dim=1)
        scores = qf @ kf.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
        q_len, k_len = q.shape[-2], k.shape[-2]
        if attn_mask is not None:
            mask = attn_mask if attn_mask.dim() == 4 else attn_mask.expand(q.shape[0], 1, q_len, k_len)
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
        if is_causal:
            scores = scores.masked_fill(~torch.ones(q_len, k_len, dtype=torch.bool).tril(), float("-inf"))
        if valid_seq_len is not None:
            past = torch.arange(k_len)[None, :] >= valid_seq_len.reshape(-1, 1)
            scores = scores.masked_fill(past[:, None, None, :], float("-inf"))
        return (torch.softmax(scores, dim=-1) @ vf).to(q.dtype)


class CardMatmulTorch:
    """torch as vllm_gaudi/extension/utils.py's Matmul module sees it on a card: everything is
    torch's, except `matmul(x, y, out=...)` with an out of another dtype than the operands.
    flat_pa (extension/ops.py), with fp32 softmax on (the recipe's VLLM_FP32_SOFTMAX), asks for
    bf16 q @ k^T into an fp32 out; CPU torch refuses an out whose dtype differs, the bridge takes it.
    No public bridge source or card test stating the rule was found: the stand-in assumes the
    card's matrix engine accumulates bf16 products in fp32 (as it does for bf16 GEMMs) and writes
    that sum to the out without a bf16 rounding. `mixed_out_calls` counts the calls it served."""

    mixed_out_calls = 0

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def matmul(x, y, out=None):
        if out is None:
            return torch.matmul(x, y)
        if out.dtype == torch.result_type(x, y):
            return torch.matmul(x, y, out=out)
        if out.dtype != torch.float32:
            raise NotImplementedError(f"card matmul stand-in: {x.dtype} @ {y.dtype} into {out.dtype}")
        CardMatmulTorch.mixed_out_calls += 1
        return out.copy_(torch.matmul(x.float(), y.float()))
