"""Helpers for tests that need a real vLLM engine or the transformers oracle."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.parallel import both_cores, engine_env
from tests.support.reaper import stop_group

REPO = Path(__file__).resolve().parents[2]


def cpu_env(tp: int = 1) -> dict:
    # Explicit per-rank CPU lists: these hosts have one NUMA node and 2 cores, and each xdist
    # worker's engines get their own (tests/support/parallel.py).
    return dict(os.environ, VLLM_TARGET_DEVICE="cpu", PYTHONPATH=str(REPO), **engine_env(tp))


def offline_env(tp: int = 1) -> dict:
    """`cpu_env` for an offline `LLM(...)` run: its engine core in the calling process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0) instead of a process of its own, which would import vLLM a
    second time and add about 20 s to each start on these hosts; the model, runner and scheduler
    are the same either way, and TP ranks still run as worker processes."""
    return dict(cpu_env(tp), VLLM_ENABLE_V1_MULTIPROCESSING="0")


def run_in_group(cmd: list[str], *, timeout: float, env: dict) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd)` from the repository, stdout and stderr together, in a process group of
    its own that is killed whole once the command is done or late (then TimeoutExpired): an engine
    core or worker that outlived its parent, or ignored SIGTERM, must not outlive the test."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    finally:
        stop_group(proc, timeout=10)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout)


def engine_spec(model, jobs, *, dtype="float32", tp=1, ep=False, load_format="auto", **kw) -> dict:
    return dict(model=str(model), jobs=jobs, dtype=dtype, tp=tp, ep=ep, load_format=load_format, **kw)


def run_engine(model, jobs, *, timeout=900, env=None, **kw) -> list:
    """Start one engine in a subprocess, run the jobs, return their results (see engine_run.py).
    `env`: variables set for the engine process on top of this one's (e.g. a port switch)."""
    return _run(engine_spec(model, jobs, **kw), kw.get("tp", 1), timeout, env)


def run_engines(specs: list[dict], *, timeout=900, env=None) -> list[list]:
    """`engine_spec`s run one after the other in one subprocess (engine_run.py says when a test may
    share one); each engine's results, in order."""
    return _run({"engines": specs}, max(s["tp"] for s in specs), timeout, env)


def _run(spec: dict, tp: int, timeout: float, env: dict | None) -> list:
    with tempfile.TemporaryDirectory() as d:
        spec_path, out_path = Path(d, "spec.json"), Path(d, "out.json")
        spec_path.write_text(json.dumps(spec))
        with both_cores(tp):
            proc = run_in_group([sys.executable, "-m", "tests.support.engine_run", str(spec_path), str(out_path)],
                                timeout=timeout, env=dict(offline_env(tp), **(env or {})))
        if proc.returncode != 0:
            # vLLM logs worker tracebacks on stdout: keep both streams, whole, for the failure message.
            raise RuntimeError(f"engine failed (rc={proc.returncode}):\n{proc.stdout}")
        return json.loads(out_path.read_text())["results"]


def oracle_prompt_logprobs(model_dir, ids, dtype="float32", model=None) -> list:
    """transformers' BeamForCausalLM: logprob of each token given its prefix ([None] first)."""
    import torch
    from transformers import BeamForCausalLM

    torch_dtype = getattr(torch, dtype)
    m = model or BeamForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype)
    with torch.no_grad():
        logits = m(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [None] + [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def max_abs_delta(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b) if x is not None and y is not None)


def mean_abs_delta(a, b) -> float:
    d = [abs(x - y) for x, y in zip(a, b) if x is not None and y is not None]
    return sum(d) / len(d)
