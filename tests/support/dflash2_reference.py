"""An independent fp32 reference of Beam's DFlash2 drafter, one request at a time, from the
published equations; it shares no code with beam_hpu (transformers 5.24 ships no DFlash2 drafter:
`transformers/models/beam/` has the target only).

Equations and where they are published:
- drafter layout and sizes: the card (huggingface.co/reflection/Beam-1.0-501B-A23B-DFlash2);
- "the drafter conditions on hidden states from Beam" at `target_layer_ids` = outputs of those
  layers, i.e. transformers' `output_hidden_states[j + 1]` (that tuple starts with the
  embeddings); the context row of a token = `hidden_norm(fc(concat of those states))`, each
  layer's key = RoPE(k_norm(k_proj(row))) and value = v_proj(row) at the token's position;
- the block: [bonus, mask, ..., mask] at the positions after the context, one non-causal forward
  (DFlash: NeMo AutoModel / vLLM speculators docs); every layer slides with window W;
- the two-tap dynamic depthwise convolution before and after each attention and MLP sublayer:
  Conv(x)_t = sum_j (base_j + delta_{t,j}[group]) * x_{t-j}, zero before the block start, the two
  deltas (input side, output side) predicted from the sublayer's input (NeMo AutoModel docs;
  vLLM speculators docs: "a projection of the current hidden state produces two dynamic kernels:
  one for the sublayer input and one for its output");
- selector: S_t(a, b) = U_t(b) + <A(a) * H(h_t), B(b)> over each drafted position's top-k, the
  anchor (bonus token) as predecessor of the first; greedy path from the anchor.
Written with explicit loops over positions and heads on purpose, so it does not mirror the
vectorised model.
"""

from __future__ import annotations

import math

import torch


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """NeoX rotation of one head vector [D] at one position."""
    D = x.shape[-1]
    half = D // 2
    out = torch.empty_like(x)
    for i in range(half):
        angle = pos * theta ** (-2.0 * i / D)
        c, s = math.cos(angle), math.sin(angle)
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


def conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, group: int) -> torch.Tensor:
    """x [B, H], base [taps, H], delta [B, taps, G] -> [B, H]."""
    B, H = x.shape
    out = torch.zeros_like(x)
    for t in range(B):
        for j in range(base.shape[0]):
            if t - j < 0:
                continue
            for g in range(H // group):
                cols = slice(g * group, (g + 1) * group)
                out[t, cols] += (base[j, cols] + delta[t, j, g]) * x[t - j, cols]
    return out


class Reference:
    def __init__(self, weights: dict[str, torch.Tensor], config: dict, embed: torch.Tensor, lm_head: torch.Tensor,
                 causal: bool = False):
        self.w = {k: v.float() for k, v in weights.items()}
        self.c, self.dc = config, config["dflash_config"]
        self.embed, self.lm_head = embed.float(), lm_head.float()
        self.causal = causal  # True only to show the comparison sees it
        self.eps = config["rms_norm_eps"]
        rp = config["rope_parameters"]
        self.theta = float(rp.get("sliding_attention", rp)["rope_theta"])

    def layer_w(self, i: int, name: str) -> torch.Tensor:
        return self.w[f"layers.{i}.{name}"]

    def context(self, hidden_states: list[torch.Tensor]) -> torch.Tensor:
        """transformers-style hidden states (index 0 = embeddings), each [S, H_t] -> rows [S, H]."""
        feats = torch.cat([hidden_states[j + 1].float() for j in self.dc["target_layer_ids"]], dim=-1)
        return rms(feats @ self.w["fc.weight"].T, self.w["hidden_norm.weight"], self.eps)

    def _kv(self, i: int, x: torch.Tensor, positions: list[int]):
        c = self.c
        nkv, D = c["num_key_value_heads"], c["head_dim"]
        k = (x @ self.layer_w(i, "self_attn.k_proj.weight").T).view(-1, nkv, D)
        v = (x @ self.layer_w(i, "self_attn.v_proj.weight").T).view(-1, nkv, D)
        kn = self.layer_w(i, "self_attn.k_norm.weight")
        k = torch.stack([torch.stack([rope(rms(k[t, h], kn, self.eps), positions[t], self.theta)
                                      for h in range(nkv)]) for t in range(k.shape[0])])
        return k, v

    def _attention(self, i: int, x: torch.Tensor, pos: list[int], ctx_rows: torch.Tensor, ctx_pos: list[int]):
        c = self.c
        nq, nkv, D, W = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["sliding_window"]
        q = (x @ self.layer_w(i, "self_attn.q_proj.weight").T).view(-1, nq, D)
        qn = self.layer_w(i, "self_attn.q_norm.weight")
        ck, cv = self._kv(i, ctx_rows, ctx_pos)
        bk, bv = self._kv(i, x, pos)
        keys, values, kpos = torch.cat([ck, bk]), torch.cat([cv, bv]), ctx_pos + pos
        out = torch.zeros(len(pos), nq * D)
        for t in range(len(pos)):
            for h in range(nq):
                qv = rope(rms(q[t, h], qn, self.eps), pos[t], self.theta)
                kv_head = h // (nq // nkv)
                logits, vals = [], []
                for j in range(len(kpos)):
                    if abs(pos[t] - kpos[j]) >= W:
                        continue
                    if self.causal and kpos[j] > pos[t]:
                        continue
                    logits.append(float(qv @ keys[j, kv_head]) / math.sqrt(D))
                    vals.append(values[j, kv_head])
                p = torch.softmax(torch.tensor(logits), dim=0)
                out[t, h * D:(h + 1) * D] = sum(pj * vj for pj, vj in zip(p, vals))
        return out @ self.layer_w(i, "self_attn.o_proj.weight").T

    def _sublayer(self, i: int, which: str, x: torch.Tensor, fn) -> torch.Tensor:
        taps, group = self.dc["conv_kernel_size"], self.dc["conv_group_size"]
        G = x.shape[-1] // group
        base = self.layer_w(i, f"{which}_conv.base_kernel")
        deltas = (x @ self.layer_w(i, f"{which}_conv.kernel_projection.weight").T).view(-1, 2, taps, G)
        y = fn(conv(x, base[0], deltas[:, 0], group))
        return conv(y, base[1], deltas[:, 1], group)

    def block(self, ctx_rows: torch.Tensor, ctx_pos: list[int], bonus: int, block_size: int) -> torch.Tensor:
        """Context rows [S, H] at ctx_pos; the block starts right after ctx_pos[-1]. -> [B, H]."""
        start = ctx_pos[-1] + 1
        pos = list(range(start, start + block_size))
        ids = [bonus] + [self.dc["mask_token_id"]] * (block_size - 1)
        h = self.embed[ids]
        for i in range(self.c["num_hidden_layers"]):
            x = rms(h, self.layer_w(i, "input_layernorm.weight"), self.eps)
            h = h + self._sublayer(i, "attention", x, lambda u: self._attention(i, u, pos, ctx_rows, ctx_pos))
            x = rms(h, self.layer_w(i, "post_attention_layernorm.weight"), self.eps)
            h = h + self._sublayer(i, "mlp", x, lambda u: self._mlp(i, u))
        return rms(h, self.w["norm.weight"], self.eps)

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        g = x @ self.layer_w(i, "mlp.gate_proj.weight").T
        u = x @ self.layer_w(i, "mlp.up_proj.weight").T
        return (torch.nn.functional.silu(g) * u) @ self.layer_w(i, "mlp.down_proj.weight").T

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        cap = self.dc["final_logit_softcapping"]
        return cap * torch.tanh((hidden @ self.lm_head.T) / cap)

    def draft(self, hidden: torch.Tensor, bonus: int):
        """Block output [B, H] -> (tokens [B-1], candidate ids [B-1, K], scores [B-1, K, K])."""
        K = self.dc["selector_top_k"]
        A, Bc = self.w["candidate_selector.predecessor_codebook"], self.w["candidate_selector.successor_codebook"]
        Hp = self.w["candidate_selector.hidden_projection.weight"]
        tokens, all_ids, all_scores = [], [], []
        prev_ids = [bonus] * K
        choice = 0
        for t in range(1, hidden.shape[0]):
            values, ids = self.logits(hidden[t]).topk(K)
            proj = Hp @ hidden[t]
            scores = torch.empty(K, K)
            for a in range(K):
                for b in range(K):
                    scores[a, b] = values[b] + (A[prev_ids[a]] * proj * Bc[ids[b]]).sum()
            choice = int(scores[choice].argmax())
            tokens.append(int(ids[choice]))
            all_ids.append(ids)
            all_scores.append(scores)
            prev_ids = ids.tolist()
        return tokens, torch.stack(all_ids), torch.stack(all_scores)
