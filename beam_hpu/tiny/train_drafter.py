"""Train the tiny EAGLE3 drafter of the committed tiny trained Beam, on CPU, deterministically:
`python -m beam_hpu.tiny.train_drafter OUT` (the committed one is `beam_hpu/tiny/data/trained_drafter/`).

Data: the tiny Beam's own tasks (`beam_hpu.tiny.tasks`, the trainer's mixture), run through the
committed target in fp32 (transformers' Beam) for its auxiliary states at `drafter.AUX_LAYERS` and
its greedy next tokens. The drafter learns to predict the target's greedy tokens, not the data's:
served at temperature 0 a draft is accepted exactly when it equals the target's argmax. Loss only
where the target was trained to predict (the tasks' loss mask), over `STEPS_AHEAD` unrolled drafting
steps (training-time test, `drafter.unrolled_logits`), later steps weighted down.

Determinism: one seed for data and initialisation, one torch thread, deterministic algorithms,
fp32 throughout: the same command writes the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
import time
from pathlib import Path

import torch

from beam_hpu.tiny.drafter import AUX_LAYERS, Drafter, DrafterShape, unrolled_logits, write_drafter
from beam_hpu.tiny.tasks import Tasks
from beam_hpu.tiny.train import MIX

TARGET = Path(__file__).parent / "data" / "trained_tiny"
DEFAULTS = dict(steps=360, lr=3e-3, seed=0, max_len=560, tokens=1600)
# Copy is an induction step for the drafter (find where its input token stood before, emit what
# followed: the key at position q sees token q through the target's state there). Like the target's
# own trainer, copies first, many and short: trained on the mixture alone for 200 steps the drafter
# matched the target on tools (95%) and echo (80%) but on copy almost never (0.4%).
PHASE1 = dict(steps=200, max_len=112)
STEPS_AHEAD = 3
STEP_DECAY = 0.8


def load_target(path: Path = TARGET):
    from transformers import AutoTokenizer, BeamForCausalLM

    model = BeamForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(path))


@torch.no_grad()
def target_states(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] -> (aux [B, L, A*H] at vLLM's ids `AUX_LAYERS`, greedy next tokens [B, L]).

    vLLM's id i is transformers' hidden_states[i] except the last (i = num layers), which
    transformers returns after the final norm: that one is the last layer's own output."""
    n = len(model.model.layers)
    last = []
    hook = model.model.layers[-1].register_forward_hook(lambda m, a, out: last.append(out[0] if isinstance(out, tuple) else out))
    try:
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    finally:
        hook.remove()
    states = list(out.hidden_states[:n]) + last
    return torch.cat([states[i] for i in AUX_LAYERS], -1), out.logits.argmax(-1)


def draw(tasks: Tasks, rng: random.Random, tokens: int, pad: int, mix=MIX):
    """Samples of `mix` (the target trainer's) until `tokens`: ids [B, L] and loss mask [B, L] (bool)."""
    samples = []
    while not samples or sum(len(s[1]) for s in samples) < tokens:
        samples.append(tasks.sample(rng, mix))
    width = max(len(s[1]) for s in samples)
    ids = torch.full((len(samples), width), pad, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.bool)
    for b, (_, s, m) in enumerate(samples):
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = torch.tensor(m)
    return ids, mask


def step_loss(drafter, embed, ids, mask, aux, greedy):
    """Mean over steps j of decay^j * CE(step j at chain p, target's greedy token after p + 1 + j),
    counted where token p + 2 + j is one the target was trained to predict."""
    B, L = ids.shape
    total = 0.0
    for j, logits in enumerate(unrolled_logits(drafter, embed, ids, aux, STEPS_AHEAD)):
        span = L - 2 - j  # chains p with p + 2 + j < L
        if span <= 0:
            break
        label = greedy[:, 1 + j: 1 + j + span]
        keep = mask[:, 2 + j: 2 + j + span]
        ce = torch.nn.functional.cross_entropy(logits[:, :span].reshape(-1, logits.shape[-1]), label.reshape(-1),
                                               reduction="none").view(B, span)
        total = total + STEP_DECAY ** j * (ce * keep).sum() / keep.sum().clamp(min=1)
    return total


def train(steps: int, lr: float, seed: int, max_len: int, tokens: int, log_every: int = 10, log=print):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    target, tok = load_target()
    embed = target.model.embed_tokens.weight.detach()
    torch.manual_seed(seed)
    shape = DrafterShape(hidden_size=embed.shape[1], vocab_size=embed.shape[0])
    drafter = Drafter(shape)
    with torch.no_grad():  # start from the target's head: the drafter first learns "what comes next"
        drafter.lm_head.weight.copy_(target.lm_head.weight)
    short, tasks, rng = Tasks(tok, PHASE1["max_len"]), Tasks(tok, max_len), random.Random(seed)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    t0, avg = time.time(), None
    for step in range(steps):
        if step < PHASE1["steps"]:
            ids, mask = draw(short, rng, tokens, tok.pad_token_id, [("copy", 1.0)])
        else:
            ids, mask = draw(tasks, rng, tokens, tok.pad_token_id)
        aux, greedy = target_states(target, ids)
        loss = step_loss(drafter, embed, ids, mask, aux, greedy)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        sched.step()
        avg = loss.item() if avg is None else 0.9 * avg + 0.1 * loss.item()
        if log_every and (step + 1) % log_every == 0:
            log(f"step {step + 1}/{steps} loss {avg:.3f} ({time.time() - t0:.0f}s)")
    return drafter.eval()


def weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].float().contiguous().numpy().tobytes())
    return h.hexdigest()


def trainer_cli(argv, description: str, defaults: dict, train, write) -> int:
    """A drafter trainer's command line: OUT and one --option per hyperparameter; writes the trained
    drafter with its hyperparameters, target and weights digest as metadata."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("out", help="drafter directory to write")
    for k, v in defaults.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    args = ap.parse_args(argv)
    hp = {k: getattr(args, k) for k in defaults}
    drafter = train(**hp)
    digest = weights_digest(drafter.published())
    write(Path(args.out), drafter, {**hp, "target": TARGET.name, "sha256": digest})
    print(f"wrote {args.out} (weights sha256: {digest[:16]})")
    return 0


def main(argv=None) -> int:
    return trainer_cli(argv, __doc__.split("\n")[0], DEFAULTS, train, write_drafter)


if __name__ == "__main__":
    raise SystemExit(main())
