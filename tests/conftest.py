"""Tiny checkpoints shared across rooms, each written once per session (per xdist worker)."""

import os

import pytest
import torch

from tests.support.gaudi_tree import MISSING, ensure_gaudi_fixes_root
from tests.support.reaper import become_subreaper, reap_leftovers
from tests.support.release_proxy import ensure_release_proxy_root
from tests.support.server import SharedServerLoadFile, SharedServers

from beam_hpu.quant.fp8_checkpoint import quantize_checkpoint
from beam_hpu.tiny.fp8_checkpoint import write_tiny_fp8_checkpoint
from beam_hpu.tiny.checkpoint import CONDITIONED_POST_NORM_GAIN, write_tiny_checkpoint

PRESET, SEED = "small", 0

# Before any test module reads them: the Gaudi-side tests run on the cached 091bbadd checkout (or one
# made from GAUDI_GIT) when the caller named none (tests/support/gaudi_tree.py), and on the release
# proxy where it differs (tests/support/release_proxy.py).
ensure_gaudi_fixes_root()
ensure_release_proxy_root()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One worker per core (`-n 2`): a worker's own torch work (the transformers oracle, training
    # steps) stays on one thread instead of both workers contending for both cores.
    torch.set_num_threads(1)

# An engine core orphaned by its API server's death stays below this process (each xdist worker,
# or pytest alone), where the end-of-session check below finds it.
become_subreaper()


@pytest.fixture(scope="session", autouse=True)
def no_serving_process_left():
    """At the end of the session (of each xdist worker: its own descendants), no vLLM engine, API
    server, router or replica a test started may still be alive; any found is named, then killed."""
    yield
    problem = reap_leftovers(os.getpid(), grace=10)
    if problem:
        pytest.fail(problem, pytrace=False)


@pytest.fixture(scope="session")
def shared_server():
    """shared_server(model_dir, extra=()) -> a running `vllm serve` of `model_dir` with the demo's
    command line plus `extra`, started once for this worker's session and stopped at its end
    (before the leftover check above, which every session sets up first)."""
    servers = SharedServers()
    yield servers.get
    servers.stop_all()


def pytest_configure(config):
    config.addinivalue_line("markers", "gaudi_tree: runs on the vllm-gaudi tree (tests/support/gaudi/); "
                                       "skipped, naming what is missing, when there is none")


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with the modules that share the demo servers as one unit of work."""
    if config.getvalue("dist") == "loadfile":
        return SharedServerLoadFile(config, log)
    return None


def pytest_collection_modifyitems(config, items):
    """Without a tree, every `gaudi_tree` test skips with what to set (before any fixture copies it)."""
    if os.environ.get("GAUDI_FIXES_ROOT"):
        return
    for item in items:
        if item.get_closest_marker("gaudi_tree"):
            item.add_marker(pytest.mark.skip(reason=MISSING))


@pytest.fixture(scope="session")
def tiny_fp32(tmp_path_factory):
    """The default tiny Beam (6 layers, window 16, 8 experts in 4 groups) in fp32."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-small-fp32"), "small", dtype="float32")


@pytest.fixture(scope="session")
def tiny_bf16(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-small-bf16"), "small", dtype="bfloat16")


@pytest.fixture(scope="session")
def tiny_wide_fp32(tmp_path_factory):
    """A second shape: window 24, 8 query heads per 2 KV heads, 16 experts in 8 groups, top-4."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-wide-fp32"), "wide", dtype="float32", seed=1)


# FP8 pairs, used by the quant and CPU-expert rooms


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(bf16 tiny Beam, its FP8 checkpoint) as `write_tiny_fp8_checkpoint` writes them."""
    root = tmp_path_factory.mktemp("tiny")
    bf16 = write_tiny_checkpoint(root / "bf16", PRESET, seed=SEED)
    return bf16, write_tiny_fp8_checkpoint(root / "fp8", PRESET, seed=SEED)


@pytest.fixture(scope="session")
def conditioned_pair(tmp_path_factory):
    """(bf16, FP8) of the same tiny Beam with post-norm gains scaled to tame routing chaos
    (`beam_hpu.tiny.CONDITIONED_POST_NORM_GAIN` says why): the model the accuracy tests measure."""
    root = tmp_path_factory.mktemp("conditioned")
    bf16 = write_tiny_checkpoint(root / "bf16", PRESET, seed=SEED, post_norm_gain=CONDITIONED_POST_NORM_GAIN)
    return bf16, quantize_checkpoint(bf16, root / "fp8")
