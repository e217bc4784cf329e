"""`beam-hpu demo --replicas N`: N replicas of the tiny Beam behind `vllm-router`.

The router takes the demo's port (8000), so the README's requests work unchanged; the replicas
take the next N ports. Ctrl-C or SIGTERM stops the router and every replica (process groups).
A replica whose process exits, or whose /health fails for `RestartPolicy.unhealthy_after_secs`,
is restarted by the fleet's supervisor (with backoff and a cap; each restart logged on stderr);
the router drops it and takes it back by its own health checks.
"""

from __future__ import annotations

import shlex
import signal
import sys
import time
from pathlib import Path

from beam_hpu.demo.serve import write_checkpoint
from beam_hpu.replicas.layout import RouterSettings, plan
from beam_hpu.replicas.restart import RestartPolicy
from beam_hpu.replicas.supervisor import Fleet, Supervisor


def _env_prefix(env: dict[str, str]) -> str:
    keys = ("VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
            "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_PORT")
    return " ".join(f"{k}={shlex.quote(env[k])}" for k in keys if k in env)


def commands_text(layout) -> str:
    lines = [f"# replica {r.index} (core {r.core})\n{_env_prefix(r.env)} {shlex.join(r.cmd)}"
             for r in layout.replicas]
    lines.append(f"# router (after the replicas answer /health)\n{shlex.join(layout.router_cmd)}")
    return "\n".join(lines)


def run(args) -> int:
    """`beam-hpu demo --replicas N` (N >= 2): the demo's checkpoint, then the fleet."""
    if args.tp != 1 or args.ep or args.draft:
        raise SystemExit("beam-hpu demo --replicas: each replica is TP 1 on its own core, without a drafter; "
                         "drop --tp/--ep/--draft")
    model_dir = write_checkpoint(args.dir, args.preset, "bfloat16", 0, args.fp8)
    try:
        layout = plan(model_dir, args.replicas, router_port=args.port, settings=RouterSettings(policy=args.policy),
                      router_exe=None if not args.print_only else "vllm-router")
    except ValueError as e:
        raise SystemExit(f"beam-hpu demo --replicas: {e}") from None
    print(commands_text(layout), flush=True)
    if args.print_only:
        return 0
    fleet = Fleet(layout, Path(args.dir).parent / "replica-logs")

    def _terminate(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, _terminate)
    supervisor = None
    try:
        print(f"starting {len(layout.replicas)} replicas ...", flush=True)
        fleet.start()
        print(fleet.describe(), flush=True)
        print(f"Application startup complete: vllm-router ({args.policy}) on {layout.router_url}; "
              f"Ctrl-C stops everything", flush=True)
        supervisor = Supervisor(fleet, RestartPolicy(), log=sys.stderr).start()
        while True:
            if fleet.router_proc.poll() is not None:
                print(f"vllm-router exited with {fleet.router_proc.returncode}; stopping", file=sys.stderr)
                return 1
            time.sleep(2)
    except KeyboardInterrupt:
        print("stopping the router and the replicas", flush=True)
        return 0
    finally:
        if supervisor is not None:
            supervisor.stop()  # first, or it would restart the replicas being stopped
        fleet.stop()
