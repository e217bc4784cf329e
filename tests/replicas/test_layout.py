"""The replicas' layout and command lines (beam_hpu.replicas.layout), checked against the
installed `vllm-router` and the demo's own `vllm serve` command."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from beam_hpu.demo.serve import serve_command
from beam_hpu.replicas.layout import POLICIES, RouterSettings, plan, router_command
from tests.support.router import router_help


def test_every_router_flag_and_policy_is_one_vllm_router_lists():
    text = router_help()
    listed = set(re.findall(r"--[a-z][a-z0-9-]+", text))
    cmd = router_command(["http://127.0.0.1:1", "http://127.0.0.1:2"], port=3, metrics_port=4)
    used = {a for a in cmd if a.startswith("--")}
    assert used <= listed, used - listed
    choices = re.search(r"--policy \{([a-z_,]+)\}", text).group(1).split(",")
    assert set(POLICIES) <= set(choices)


def test_plan_gives_each_replica_its_port_core_and_internal_ports(tmp_path):
    layout = plan(tmp_path, 3, router_port=9000, internal_port_base=50000)
    assert [r.port for r in layout.replicas] == [9001, 9002, 9003]
    cores = __import__("os").cpu_count()
    assert [r.env["VLLM_CPU_OMP_THREADS_BIND"] for r in layout.replicas] == [str(i % cores) for i in range(3)]
    assert [r.env["VLLM_PORT"] for r in layout.replicas] == ["50000", "50100", "50200"]
    # Each replica is the demo's own serve command on its port.
    assert layout.replicas[1].cmd == serve_command(tmp_path, port=9002)
    cmd = layout.router_cmd
    assert cmd[cmd.index("--port") + 1] == "9000" and cmd[cmd.index("--policy") + 1] == "cache_aware"
    urls = cmd[cmd.index("--worker-urls") + 1:cmd.index("--policy")]
    assert urls == ["http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"]
    assert cmd[cmd.index("--prometheus-port") + 1] == "9004"


def test_plan_refuses_what_cannot_work(tmp_path):
    with pytest.raises(ValueError, match="at least 2 replicas"):
        plan(tmp_path, 1)
    with pytest.raises(ValueError, match="distinct ports"):
        plan(tmp_path, 2, router_port=8000, replica_ports=[8000, 8001])
    with pytest.raises(ValueError, match="policy 'fastest'"):
        router_command(["http://a"], port=1, metrics_port=2, settings=RouterSettings(policy="fastest"))


def test_demo_print_only_prints_every_command(tmp_path):
    out = subprocess.run([sys.executable, "-m", "beam_hpu.cli", "demo", "--dir", str(tmp_path / "d"), "--replicas", "2",
                          "--print-only"], capture_output=True, text=True, check=True).stdout
    assert out.count(" serve ") == 2 and "--port 8001" in out and "--port 8002" in out
    assert "VLLM_CPU_OMP_THREADS_BIND=0" in out and "VLLM_CPU_OMP_THREADS_BIND=1" in out
    router = [line for line in out.splitlines() if line.startswith("vllm-router")][0]
    assert "--port 8000" in router and "--policy cache_aware" in router
    assert "--worker-urls http://127.0.0.1:8001 http://127.0.0.1:8002" in router


def test_demo_replicas_refuses_tp(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "beam_hpu.cli", "demo", "--dir", str(tmp_path / "d"), "--replicas", "2",
                           "--tp", "2", "--print-only"], capture_output=True, text=True)
    assert proc.returncode != 0 and "each replica is TP 1" in proc.stderr


def test_demo_replicas_refuses_an_unknown_policy(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "beam_hpu.cli", "demo", "--dir", str(tmp_path / "d"), "--replicas", "2",
                           "--policy", "fastest", "--print-only"], capture_output=True, text=True)
    assert proc.returncode != 0 and "policy 'fastest'" in proc.stderr and "cache_aware" in proc.stderr
