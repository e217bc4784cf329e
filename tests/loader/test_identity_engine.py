"""`--load-format beam` leaves exactly the model state `auto` leaves: every tensor, bit for bit,
on every rank: a bf16 checkpoint at TP 2 (experts sliced by rows) and an FP8 one at TP 2 + EP
(experts whole, each on its rank; FP8 weights and scales sliced by TP elsewhere). Under EP the
check also shows each rank read only its own experts (accounting, against the headers). FP8
experts sliced by rows (TP 2 without EP) take the bf16 run's row slicing, which reads bytes
whatever their dtype, with their per-channel scales sliced as the FP8 attention's are; TP 2 FP8
without EP is also served against TP 1 in tests/runtime/expert_parallel.

Not at TP 1 here (two engine starts of the suite's longest test): a TP 1 rank reads every tensor
whole, the degenerate slice of the TP 2 ranks checked below; the reader and placement at TP 1 are
compared with the model loader's own state, tensor by tensor and byte count, in
tests/loader/test_load_toy.py (tp=1), and an FP8 checkpoint loaded at TP 1 with
`--load-format beam` is served and gated in tests/gates/test_gates_served.py and
tests/e2e/test_demo_fp8_serve.py."""

import pytest
import torch

from tests.loader.accounting import expected_rank_bytes, header_bytes
from tests.support.engines import engine_spec, run_engines


def loaded_states(model, tmp_path, dtype, tp, ep) -> dict:
    """load format -> each rank's (state, load report): `auto`'s engine, then `beam`'s, one after
    the other in one process (each engine's ranks are processes of their own)."""
    specs = []
    for load_format in ("auto", "beam"):
        out = tmp_path / f"{load_format}-tp{tp}-ep{int(ep)}"
        out.mkdir()
        specs.append(engine_spec(model, [{"dump_state": str(out)}], dtype=dtype, tp=tp, ep=ep, load_format=load_format))
    return {load_format: [(torch.load(r["path"]), r["load_report"]) for r in ranks]
            for load_format, (ranks,) in zip(("auto", "beam"), run_engines(specs))}


def assert_identical(auto: dict, beam: dict, where: str) -> int:
    assert sorted(auto) == sorted(beam), f"{where}: different tensor names"
    for name, a in auto.items():
        b = beam[name]
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {name} {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        # Bytes, not values: NaN != NaN and -0.0 == 0.0 would hide or invent differences.
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{where}: {name} differs"
    return len(auto)


def check_identity(model, tmp_path, dtype, configs):
    for tp, ep in configs:
        states = loaded_states(model, tmp_path, dtype, tp, ep)
        auto, beam = states["auto"], states["beam"]
        assert len(auto) == len(beam) == tp
        for rank, ((a, _), (b, report)) in enumerate(zip(auto, beam)):
            where = f"{model.name} tp={tp} ep={ep} rank {rank}"
            assert assert_identical(a, b, where) > 50
            expected = expected_rank_bytes(model, tp=tp, rank=rank, ep=ep)
            assert report["data_bytes"] == expected, f"{where}: read {report['data_bytes']} bytes, expected {expected}"
            assert report["header_bytes"] == header_bytes(model)  # the only overhead besides gap reads
            assert report["gap_bytes"] < expected  # holes of row-parallel slices, read over (see reader)


@pytest.mark.slow
def test_bf16_state_identical_to_auto(tiny_bf16, tmp_path):
    # TP 2 without EP: experts sliced by rows, as attention is; placing whole experts on their
    # ranks (EP) is the FP8 run's, whose embeddings, norms and lm_head are bf16 too.
    check_identity(tiny_bf16, tmp_path, "bfloat16", configs=[(2, False)])


@pytest.mark.slow
def test_fp8_state_identical_to_auto(tiny_fp8, tmp_path):
    # TP 2 + EP: FP8 weights and their per-channel scales sliced by TP in attention and dense
    # layers, whole FP8 experts with their scales on their ranks.
    check_identity(tiny_fp8, tmp_path, "bfloat16", configs=[(2, True)])
