"""The harness that keeps two xdist workers out of each other's way (tests/support/parallel.py):
a multi-rank engine waits while another worker's multi-rank engine runs; a single-rank one does not."""

import fcntl
import re
import subprocess
import sys
import time

from tests.support.engines import REPO
from tests.support.parallel import both_cores, both_cores_lock_path

HOLD = """
import sys, time
from tests.support.parallel import both_cores
with both_cores(int(sys.argv[1])):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def held_elsewhere() -> bool:
    with open(both_cores_lock_path(), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def hold_in_child(tp: int, seconds: float) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(tp), str(seconds)], cwd=REPO, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_multi_rank_engine_waits_for_another_workers_multi_rank_engine(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", f"harness-test-{time.monotonic_ns()}")
    child = hold_in_child(2, 2.0)
    try:
        assert held_elsewhere()
        start = time.monotonic()
        with both_cores(2):
            waited = time.monotonic() - start
        assert waited > 1.0  # entered only once the child let go (it holds the cores for 2 s)
    finally:
        child.wait(10)
    assert not held_elsewhere()


def test_a_single_rank_engine_neither_takes_nor_waits_for_the_cores(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", f"harness-test-{time.monotonic_ns()}")
    child = hold_in_child(1, 0.0)
    child.wait(10)
    with both_cores(2):
        child = hold_in_child(1, 0.0)  # would block here if TP 1 took the lock
        child.wait(10)


def test_the_shared_server_modules_are_the_fixtures_users_and_one_unit_of_work():
    from tests.support.server import SHARED_SERVER_MODULES, SharedServerLoadFile

    users = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
             if re.search(r"^def \w+\([^)]*\bshared_server\b", p.read_text(), re.M)}  # taken as a fixture
    assert set(SHARED_SERVER_MODULES) == users
    split = SharedServerLoadFile._split_scope
    scheduler = SharedServerLoadFile.__new__(SharedServerLoadFile)
    scopes = {split(scheduler, f"{m}::test_x[a]") for m in SHARED_SERVER_MODULES}
    assert len(scopes) == 1
    assert split(scheduler, "tests/e2e/test_soak.py::test_x") == "tests/e2e/test_soak.py"
