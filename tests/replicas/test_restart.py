"""The restart decision (beam_hpu/replicas/restart.py) over observed (time, alive, healthy) series:
what the fleet's supervisor does for an exit, a hang, a slow start, a crash loop. Times are plain
numbers fed in, not a clock: the verdicts do not depend on this host's speed."""

from beam_hpu.replicas.restart import ReplicaWatch, RestartPolicy

POLICY = RestartPolicy(unhealthy_after_secs=20, startup_timeout_secs=100, backoff_initial_secs=1,
                       backoff_multiplier=2, backoff_max_secs=5, max_restarts=3, window_secs=300, stable_secs=60)


def drive(watch, series):
    """[(t, alive, healthy)] -> [(t, action)] for every action other than none."""
    return [(t, d.action) for t, a, h in series if (d := watch.observe(t, a, h)).action != "none"]


def test_backoff_doubles_up_to_its_cap():
    assert [POLICY.backoff(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 5, 5]


def test_an_exited_replica_is_killed_then_started_after_the_backoff():
    w = ReplicaWatch(POLICY, started_at=0)
    acts = drive(w, [(1, True, True), (2, False, False), (2.5, False, False), (3, False, False), (4, True, False)])
    assert acts == [(2, "kill"), (3, "start")]
    assert w.state == "starting" and w.restarts == [2]


def test_a_hung_replica_is_restarted_only_after_the_unhealthy_limit():
    w = ReplicaWatch(POLICY, started_at=0)
    series = [(t, True, t < 10) for t in range(0, 40)]  # healthy until 9, then alive but silent
    acts = drive(w, series)
    assert acts[0] == (29, "kill")  # last healthy at 9, +20 s
    # A pause shorter than the limit (a SIGSTOP then SIGCONT) is left alone.
    w2 = ReplicaWatch(POLICY, started_at=0)
    assert drive(w2, [(t, True, not 10 <= t < 25) for t in range(0, 60)]) == []


def test_a_starting_replica_gets_the_startup_timeout_not_the_unhealthy_limit():
    w = ReplicaWatch(POLICY, started_at=0)
    assert drive(w, [(t, True, False) for t in range(0, 100)]) == []
    assert drive(w, [(100, True, False)]) == [(100, "kill")]


def test_a_crash_loop_hits_the_cap_and_is_given_up():
    w = ReplicaWatch(POLICY, started_at=0)
    acts, t = [], 0.0
    for _ in range(6):
        t += 10
        acts += drive(w, [(t, True, True), (t + 1, False, False), (t + 7, False, False)])
    kinds = [a for _, a in acts]
    assert kinds == ["kill", "start"] * 3 + ["give_up"]
    assert w.state == "given_up" and drive(w, [(t + 100, False, False)]) == []


def test_backoff_resets_after_a_stable_run():
    w = ReplicaWatch(POLICY, started_at=0)
    drive(w, [(1, False, False), (2, False, False)])
    drive(w, [(3, False, False), (5, False, False)])  # second failure before becoming healthy: attempt 2
    assert w.attempt == 2
    drive(w, [(t, True, True) for t in range(6, 70)])
    assert w.attempt == 0
    assert drive(w, [(200, False, False)])[0] == (200, "kill") and w.restart_at == 201
