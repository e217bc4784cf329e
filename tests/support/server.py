"""A real `vllm serve` process for end-to-end tests: started with the demo's own command line,
waited for on /health, stopped (process group) at teardown."""

import contextlib
import os
import subprocess
import time
from pathlib import Path

import httpx
from xdist.scheduler import LoadFileScheduling

from beam_hpu.demo.serve import SERVED_NAME, serve_command, serve_env
from tests.support.engines import REPO
from tests.support.parallel import both_cores, engine_env, free_port
from tests.support.reaper import stop_group


class Server:
    def __init__(self, model_dir, *, tp=1, ep=False, extra=None, env=None, log_path=None, timeout=600,
                 host_cpus=None):
        """`host_cpus`: CPUs for the API server and the engine-core process (the model worker binds
        itself to VLLM_CPU_OMP_THREADS_BIND whatever they are); None leaves them where the OS puts them."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.model = SERVED_NAME
        self.cmd = serve_command(model_dir, port=self.port, tp=tp, ep=ep, extra=extra)
        full_env = serve_env(tp)
        full_env.update(engine_env(tp), PYTHONPATH=str(REPO))
        full_env.update(env or {})
        self.log_path = Path(log_path or f"/tmp/beam-hpu-serve-{self.port}.log")
        self.log = open(self.log_path, "w")
        pin = None if host_cpus is None else (lambda: os.sched_setaffinity(0, host_cpus))
        self.cores = contextlib.ExitStack()  # a multi-rank server holds both cores until stop()
        self.cores.enter_context(both_cores(tp))
        try:
            self.proc = subprocess.Popen(self.cmd, env=full_env, stdout=self.log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=pin)
        except BaseException:
            self.cores.close()
            raise
        self._wait(timeout)

    def _wait(self, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.stop()  # the leader's exit leaves its engine core behind otherwise
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log_text()[-8000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"vllm serve not healthy after {timeout}s:\n{self.log_text()[-8000:]}")

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def healthy(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self):
        """The whole process group, even when `vllm serve` itself has exited: its engine core may
        have ignored SIGTERM (tests/support/reaper.py)."""
        stop_group(self.proc, timeout=60)
        if not self.log.closed:
            self.log.close()
        self.cores.close()


class SharedServers:
    """Servers kept for a whole test session (of one xdist worker), one per command line: the
    modules that only send requests to the demo's server share its start (about 40 s each on
    these hosts) instead of each starting their own. A server found dead is started again: the
    module that killed it is the one that must notice."""

    def __init__(self):
        self._servers: dict[tuple, Server] = {}

    def get(self, model_dir, extra=()) -> Server:
        key = (str(model_dir), tuple(extra))
        server = self._servers.get(key)
        if server is None or server.proc.poll() is not None or not server.healthy():
            if server is not None:
                server.stop()
            server = self._servers[key] = Server(model_dir, extra=list(extra))
        return server

    def stop_all(self):
        for server in self._servers.values():
            server.stop()
        self._servers.clear()


# The modules whose tests read the session's shared demo servers (`shared_server`; a test checks
# this list against the fixture's users): under `--dist loadfile` they form one unit of work, so
# one xdist worker runs them all and each server starts once per run instead of once per worker.
SHARED_SERVER_MODULES = ("tests/e2e/test_bad_input.py", "tests/e2e/test_tools.py", "tests/e2e/test_spec_drafter.py",
                         "tests/e2e/test_spec_ngram.py", "tests/e2e/test_spec_dflash2.py",
                         "tests/gates/test_gates_served.py")


class SharedServerLoadFile(LoadFileScheduling):
    """xdist's `loadfile` (one module = one unit of work), with SHARED_SERVER_MODULES as one unit."""

    def _split_scope(self, nodeid: str) -> str:
        module = super()._split_scope(nodeid)
        return "shared-servers" if module in SHARED_SERVER_MODULES else module
