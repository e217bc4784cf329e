"""When a replica is restarted: a plain decision over what a supervisor observes (no processes here).

The fleet's supervisor (`supervisor.Supervisor`) polls each replica about once a second and asks
`ReplicaWatch.observe(now, alive, healthy)` what to do. A replica is restarted when

- its process exited (vLLM's API server exits by itself a few seconds after its engine core dies:
  its watchdog shuts the server down unless VLLM_KEEP_ALIVE_ON_ENGINE_DEATH is set), or
- it is alive but its /health has failed for `unhealthy_after_secs` in a row (a hung replica:
  SIGSTOP on CPU, a stuck collective on a node), or
- it never became healthy within `startup_timeout_secs` of its start (the node's value is the
  recipe's VLLM_ENGINE_READY_TIMEOUT_S).

Restarts back off (`backoff_initial_secs`, times `backoff_multiplier` per restart, at most
`backoff_max_secs`) and are capped: more than `max_restarts` within `window_secs` and the watch
gives up on that replica (a crash loop is an operator's problem, not something to hammer). A
replica healthy for `stable_secs` has its backoff reset.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    unhealthy_after_secs: float = 20.0
    startup_timeout_secs: float = 600.0
    backoff_initial_secs: float = 1.0
    backoff_multiplier: float = 2.0
    backoff_max_secs: float = 60.0
    max_restarts: int = 5
    window_secs: float = 600.0
    stable_secs: float = 60.0
    health_timeout_secs: float = 2.0  # one /health probe's timeout
    poll_secs: float = 1.0

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before restart number `attempt` (1-based) of a run of failures."""
        return min(self.backoff_initial_secs * self.backoff_multiplier ** max(attempt - 1, 0), self.backoff_max_secs)


@dataclass(frozen=True)
class Decision:
    action: str  # "none", "kill" (stop what is left, then wait out the backoff), "start", "give_up"
    reason: str = ""


NONE = Decision("none")


@dataclass
class ReplicaWatch:
    """One replica's restart state. States: "starting" (spawned, not yet healthy), "running"
    (healthy at least once since its start), "backoff" (down, waiting to be started again),
    "given_up"."""

    policy: RestartPolicy
    state: str = "starting"
    started_at: float = 0.0
    healthy_since: float | None = None
    last_healthy: float | None = None
    down_since: float | None = None
    restart_at: float | None = None
    attempt: int = 0  # restarts in the current run of failures (backoff exponent)
    restarts: list[float] = field(default_factory=list)  # when each restart began (for the cap)

    def observe(self, now: float, alive: bool, healthy: bool) -> Decision:
        p = self.policy
        if self.state == "given_up":
            return NONE
        if self.state == "backoff":
            if now >= self.restart_at:
                self.state, self.started_at = "starting", now
                self.healthy_since = self.last_healthy = None
                return Decision("start", f"restart {self.attempt} after {p.backoff(self.attempt):.1f}s backoff")
            return NONE
        if alive and healthy:
            if self.state == "starting" or self.healthy_since is None:
                self.healthy_since = now
            self.state, self.last_healthy = "running", now
            if self.attempt and now - self.healthy_since >= p.stable_secs:
                self.attempt = 0
            return NONE
        if self.state == "running":
            self.healthy_since = None
        reason = self._failure(now, alive)
        if reason is None:
            return NONE
        return self._down(now, reason)

    def _failure(self, now: float, alive: bool) -> str | None:
        p = self.policy
        if not alive:
            return "process exited"
        if self.state == "starting":
            if now - self.started_at >= p.startup_timeout_secs:
                return f"not healthy {now - self.started_at:.0f}s after start (startup timeout {p.startup_timeout_secs:.0f}s)"
            return None
        unhealthy_for = now - (self.last_healthy if self.last_healthy is not None else self.started_at)
        if unhealthy_for >= p.unhealthy_after_secs:
            return f"alive but /health failing for {unhealthy_for:.0f}s (limit {p.unhealthy_after_secs:.0f}s)"
        return None

    def _down(self, now: float, reason: str) -> Decision:
        p = self.policy
        recent = [t for t in self.restarts if now - t < p.window_secs]
        if len(recent) >= p.max_restarts:
            self.state = "given_up"
            return Decision("give_up", f"{reason}; {len(recent)} restarts in the last {p.window_secs:.0f}s "
                                       f"(cap {p.max_restarts}): not restarting")
        self.attempt += 1
        self.restarts = recent + [now]
        self.state, self.down_since = "backoff", now
        self.restart_at = now + p.backoff(self.attempt)
        return Decision("kill", f"{reason}; restart {self.attempt} in {p.backoff(self.attempt):.1f}s")
