"""A toy "rank" of a TP/EP model whose weight loaders do what vLLM's do, and its checkpoint.

Loaders narrow rows (column-parallel), narrow columns (row-parallel), place local experts into a
stacked parameter and skip the others, copy replicated tensors whole, cast dtypes, and compute on
one tensor (a per-head bias repeated per channel, as Beam's gate bias is). Small enough to load in
a unit test without vLLM's engine.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

R, C, E, REPEAT = 8, 6, 4, 2


class ToyRank(nn.Module):
    def __init__(self, tp=1, rank=0, ep=False):
        super().__init__()
        self.tp, self.rank, self.ep = tp, rank, ep
        self.experts = range(rank * E // tp, (rank + 1) * E // tp) if ep else range(E)
        p = lambda *shape, dt=torch.bfloat16: nn.Parameter(torch.full(shape, -7.0, dtype=dt), requires_grad=False)
        self.col = p(R // tp, C)
        self.row = p(R, C // tp)
        self.norm = p(C, dt=torch.float32)
        self.cast = p(C, dt=torch.float32)  # stored bf16 in the checkpoint
        self.w13 = p(len(self.experts), 2 * R, C)
        self.bias = p(R // tp * REPEAT)

    def load_weights(self, weights):
        loaded = set()
        for name, t in weights:
            rows = R // self.tp
            if name == "col.weight":
                self.col.data.copy_(t.narrow(0, self.rank * rows, rows))
            elif name == "row.weight":
                self.row.data.copy_(t.narrow(1, self.rank * (C // self.tp), C // self.tp))
            elif name in ("norm.weight", "cast.weight"):
                getattr(self, name.split(".")[0]).data.copy_(t)
            elif name == "bias":
                self.bias.data.copy_(t.narrow(0, self.rank * rows, rows).repeat_interleave(REPEAT))
            elif name.startswith("experts."):
                _, e, proj, _ = name.split(".")
                if int(e) not in self.experts:
                    continue
                self.w13.data[int(e) - self.experts.start].narrow(0, 0 if proj == "gate" else R, R).copy_(t)
            else:
                raise KeyError(f"no parameter for {name!r}")
            loaded.add(name)
        return loaded

    def expected_bytes(self) -> int:
        """Tensor bytes this rank needs: the toy's sharding written out by hand."""
        bf16 = 2
        return (R // self.tp * C * bf16 + R * (C // self.tp) * bf16 + C * 4 + C * bf16
                + len(self.experts) * 2 * R * C * bf16 + R // self.tp * bf16)


def toy_tensors(seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    bf = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)
    t = {"col.weight": bf(R, C), "row.weight": bf(R, C), "norm.weight": torch.randn(C, generator=g),
         "cast.weight": bf(C), "bias": bf(R)}
    for e in range(E):
        t[f"experts.{e}.gate.weight"] = bf(R, C)
        t[f"experts.{e}.up.weight"] = bf(R, C)
    return t


def write_toy_checkpoint(directory: Path, tensors=None, shards=2) -> Path:
    """Tensors split over `shards` files in name order, with an index, as HF writes them."""
    tensors = tensors or toy_tensors()
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(directory / fname))
        weight_map.update({n: fname for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def state_bytes(model: nn.Module) -> dict[str, bytes]:
    return {k: v.detach().reshape(-1).view(torch.uint8).numpy().tobytes() for k, v in model.state_dict().items()}
