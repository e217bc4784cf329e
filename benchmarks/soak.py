"""A bounded soak of the replica fleet: load, faults on a schedule, replicas that come back alone.

    python benchmarks/soak.py [--unfaulted-secs 60] [--tail-secs 20] [--clients 4] [--deadline 120]

Loopback only, stops by itself. Starts 2 replicas of the tiny trained Beam (the demo's `vllm
serve`, TP 1, one core each) behind `vllm-router` (the demo's RouterSettings), with the demo's
supervisor restarting replicas (RestartPolicy below), then runs `beam_hpu.replicas.soak`:
a warm-up, an unfaulted phase, and a faulted phase under the same load with the faults of
`default_schedule` (replica 0: engine core SIGKILLed, API server SIGKILLed, hung by SIGSTOP
until the supervisor restarts it; replica 1: SIGSTOPped past the router's health check, then
SIGCONT). It prints every input, the table (requests by outcome, router retries, latency and
TTFT percentiles, recovery per fault, survivors' heap / fds / threads against a bound from the
same run (`growth_bounds`), answers equal to the unfaulted run's), and what was checked.

The figures are one run on this host; latency on 2 shared cores says nothing about Gaudi.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from beam_hpu.replicas.layout import RouterSettings, plan  # noqa: E402
from beam_hpu.replicas.restart import RestartPolicy  # noqa: E402
from beam_hpu.replicas.soak import default_schedule, report, run_soak, summary_ok  # noqa: E402
from beam_hpu.replicas.soak_load import cases  # noqa: E402
from beam_hpu.replicas.supervisor import Fleet, Supervisor  # noqa: E402
from beam_hpu.tiny.checkpoint import TRAINED_DIR  # noqa: E402

# The hang fault holds SIGSTOP until the supervisor acts: unhealthy_after_secs must exceed the stop
# fault's hold (health interval x (threshold + 2) = 8 s with the demo's router), or the
# supervisor would restart a replica the schedule means to continue.
SOAK_POLICY = RestartPolicy(unhealthy_after_secs=20.0, startup_timeout_secs=600.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--unfaulted-secs", type=float, default=60.0)
    ap.add_argument("--tail-secs", type=float, default=20.0, help="load after the last fault's recovery")
    ap.add_argument("--gap-secs", type=float, default=5.0, help="healthy load before each fault")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients")
    ap.add_argument("--deadline", type=float, default=120.0, help="a request not done by then is hung")
    ap.add_argument("--recover-timeout", type=float, default=300.0)
    ap.add_argument("--router-port", type=int, default=8700)
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args(argv)

    settings = RouterSettings()
    layout = plan(TRAINED_DIR, 2, router_port=args.router_port, internal_port_base=46000)
    metrics_url = f"http://127.0.0.1:{args.router_port + 3}/metrics"
    schedule = default_schedule(settings.health_check_interval_secs, settings.health_failure_threshold)
    print("inputs:")
    print(f"  fleet: 2 replicas of {TRAINED_DIR.name} (TP 1, one core each) behind vllm-router on "
          f"{layout.router_url}; router settings {dataclasses.asdict(settings)}")
    print(f"  supervisor: {dataclasses.asdict(SOAK_POLICY)}")
    print(f"  load: {args.clients} clients cycling through {[c.name for c in cases()]}; "
          f"unfaulted {args.unfaulted_secs:.0f}s; deadline {args.deadline:.0f}s; gap before each fault "
          f"{args.gap_secs:.0f}s; tail {args.tail_secs:.0f}s")
    print(f"  faults, one at a time, each once the fleet is healthy: {[dataclasses.astuple(f) for f in schedule]}")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="soak-")
    fleet = Fleet(layout, log_dir)
    supervisor = None
    t0 = time.monotonic()
    try:
        fleet.start()
        print(f"fleet up in {time.monotonic() - t0:.0f}s (logs in {log_dir})", flush=True)
        supervisor = Supervisor(fleet, SOAK_POLICY, log=sys.stdout).start()
        res = run_soak(fleet, supervisor, schedule=schedule, unfaulted_secs=args.unfaulted_secs,
                       tail_secs=args.tail_secs, clients=args.clients, deadline=args.deadline,
                       gap_secs=args.gap_secs, recover_timeout=args.recover_timeout, metrics_url=metrics_url,
                       log=lambda m: print(m, flush=True))
    finally:
        if supervisor is not None:
            supervisor.stop()
        fleet.stop()
    print()
    print(report(res))
    problems = summary_ok(res)
    print()
    print("checks: " + ("all hold (no lost request, answers equal, every fault recovered, survivors within bounds, "
                        "nothing left running)" if not problems else "FAILED:\n  " + "\n  ".join(problems)))
    print(f"total {time.monotonic() - t0:.0f}s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
