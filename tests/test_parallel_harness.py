"""The harness that keeps two xdist workers out of each other's way (tests/support/parallel.py):
a multi-rank engine waits while another worker's multi-rank engine runs; a single-rank one does not."""

import fcntl
import re
import select
import subprocess
import sys
import threading
import time

from tests.support.engines import REPO
from tests.support.parallel import both_cores, both_cores_lock_path

HOLD = """
import sys
from tests.support.parallel import both_cores
with both_cores(int(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.readline()  # until the test lets go
"""


def held_elsewhere() -> bool:
    with open(both_cores_lock_path(), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def hold_in_child(tp: int) -> subprocess.Popen:
    """A process (another worker's engine) inside both_cores(tp) until its stdin gets a line."""
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(tp)], cwd=REPO, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    if not select.select([child.stdout], [], [], 30)[0]:  # it waits for the cores: a defect, not a hang
        child.kill()
        raise AssertionError(f"a TP {tp} engine did not get in within 30 s")
    assert child.stdout.readline().strip() == "held"
    return child


def let_go(child: subprocess.Popen):
    child.communicate("go\n", timeout=30)


def test_a_multi_rank_engine_waits_for_another_workers_multi_rank_engine(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", f"harness-test-{time.monotonic_ns()}")
    child = hold_in_child(2)
    entered = threading.Event()

    def engine():
        with both_cores(2):
            entered.set()

    waiter = threading.Thread(target=engine, daemon=True)
    try:
        assert held_elsewhere()
        waiter.start()
        # The child holds the cores until told otherwise, so however slow the host, entering now is the defect.
        assert not entered.wait(0.5)
    finally:
        let_go(child)
    assert entered.wait(30)
    waiter.join(30)
    assert not held_elsewhere()


def test_a_single_rank_engine_neither_takes_nor_waits_for_the_cores(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", f"harness-test-{time.monotonic_ns()}")
    with both_cores(2):
        let_go(hold_in_child(1))  # hold_in_child would block here if TP 1 took the lock
    child = hold_in_child(1)
    try:
        assert not held_elsewhere()  # and a TP 1 engine leaves the cores free
    finally:
        let_go(child)


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
