"""How many tensor bytes a rank *should* read, from the published names and config alone.

Written from Beam's sharding, independently of the loader (which asks vLLM's weight loaders):
column-parallel tensors (q/k/v, the attention gate and its bias, dense gate/up, embeddings, LM
head) give a rank 1/tp of their rows, row-parallel ones (o_proj, dense down) 1/tp of their
columns but all of their per-output-channel scales; KV heads are replicated when tp exceeds them.
Experts: under EP a rank reads only its own (linear placement), whole; without EP every expert is
TP-sliced like a dense MLP. Norms, the router and its bias are read whole.
"""

import json
import re
from pathlib import Path

from safetensors import safe_open

EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale)$")
COLUMN = re.compile(r"(self_attn\.(q_proj|gate_proj)\.(weight|weight_scale)|self_attn\.gate_bias"
                    r"|mlp\.(gate_proj|up_proj)\.(weight|weight_scale)|embed_tokens\.weight|lm_head\.weight)$")
KV = re.compile(r"self_attn\.(k_proj|v_proj)\.(weight|weight_scale)$")
ROW_WEIGHT = re.compile(r"(self_attn\.o_proj|mlp\.down_proj)\.weight$")


def tensor_bytes(model_dir: Path) -> dict[str, int]:
    sizes = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                t = st.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                sizes[name] = n * {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}[t.get_dtype()]
    return sizes


def header_bytes(model_dir: Path) -> int:
    """The fixed per-rank overhead: each shard's 8-byte length and JSON header, read once."""
    total = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with open(f, "rb") as fh:
            total += 8 + int.from_bytes(fh.read(8), "little")
    return total


def local_experts(num_experts: int, ep_size: int, rank: int) -> range:
    base, rem = divmod(num_experts, ep_size)
    start = rank * base + min(rank, rem)
    return range(start, start + base + (rank < rem))


def expected_rank_bytes(model_dir, *, tp: int, rank: int, ep: bool) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    nkv = cfg["num_key_value_heads"]
    mine = local_experts(cfg["num_experts"], tp, rank)
    total = 0
    for name, n in tensor_bytes(model_dir).items():
        m = EXPERT.search(name)
        if m and ep:
            total += n if int(m.group(1)) in mine else 0
        elif m:  # TP-sliced expert: gate/up rows, down columns; down's scales are per output row
            total += n if (m.group(2), m.group(3)) == ("down_proj", "weight_scale") else n // tp
        elif COLUMN.search(name) or ROW_WEIGHT.search(name):
            total += n // tp
        elif KV.search(name):
            total += n * max(nkv // tp, 1) // nkv
        else:
            total += n
    return total
