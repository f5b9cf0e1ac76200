"""Optuna studies that several sweep workers share (processes, GPUs of one host, several hosts).

The storage is Optuna's RDB storage (SQLite for one host, PostgreSQL for several: ``--storage
postgresql://...``); nothing here coordinates beyond what it stores:

* A worker claims a config before compiling it: it tags its trial with the config's key, then reads
  the study, and goes on only when no other live or measured trial carries that key. Both of two
  racing workers write before they read, so at least one sees the other: never both measure it
  (both may step back; the config stays free for a later proposal). One that steps back skips the
  config (``taken``) or, when the other has measured it, records a duplicate of that value. A one-off
  task (the confirm) cannot be left for a later proposal: ``claim_alone`` looks again after yielding.
* A worker beats a heartbeat for each trial it holds (Optuna's heartbeat, every LAB_HEARTBEAT_S s). A
  trial whose worker fell silent for LAB_GRACE_S s is failed by the next worker that looks, and its
  config is enqueued again (retry_callback: a fresh trial, none of the dead one's tags), so a dead
  worker's trial is retried, not lost. A worker that was only slow finds its trial failed at its next
  write to it, keeps its row and goes on.
"""
from __future__ import annotations

import os
import random
import socket
import threading
import time
import warnings

MAX_RETRY = 2  # a config whose worker died this many times is left failed


def open_storage(url: str):
    """RDB storage with heartbeats (every LAB_HEARTBEAT_S s, default 10; a worker silent for
    LAB_GRACE_S s, default 120, is taken for dead) and retry of dead workers' trials."""
    from optuna.exceptions import ExperimentalWarning
    from optuna.storages import RDBStorage
    # The lab drives studies by ask / tell with Optuna's heartbeat run per trial (Heartbeats below);
    # Optuna warns that heartbeats are experimental and meant for Study.optimize.
    warnings.filterwarnings("ignore", category=ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    heartbeat, grace = int(os.environ.get("LAB_HEARTBEAT_S", "10")), int(os.environ.get("LAB_GRACE_S", "120"))
    # SQLite: wait for a lock instead of failing when other workers write (one host only).
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    for attempt in range(5):
        try:
            return RDBStorage(url, engine_kwargs=kwargs, heartbeat_interval=heartbeat, grace_period=grace,
                              heartbeat_stale_trial_callback=retry_callback())
        except storage_errors():
            # Workers that start together on a new database race to create Optuna's tables; the
            # losers see a duplicate-key error and find the tables there on the next try.
            if attempt == 4:
                raise
            time.sleep(0.2 + random.random())


def create_database(server_url: str, name: str) -> str:
    """Create database ``name`` (dropped first if it exists) on the PostgreSQL server of ``server_url``;
    returns its URL (the server URL with the database name replaced, query kept)."""
    _admin(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', f'CREATE DATABASE "{name}"')
    base, _, query = server_url.partition("?")
    return f"{base.rsplit('/', 1)[0]}/{name}" + (f"?{query}" if query else "")


def drop_database(server_url: str, name: str) -> None:
    _admin(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _admin(server_url: str, *statements: str) -> None:
    """Run statements outside a transaction (CREATE / DROP DATABASE need that) on the server's database."""
    import sqlalchemy as sa
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        for statement in statements:
            c.execute(sa.text(statement))
    admin.dispose()


ORDER = "lab_order"   # system attribute: a queued config's place in the queue, kept when it is put back


def order_of(trial) -> int:
    """A queued (frozen) trial's place in the queue: its number, or the number of the first trial of its config's
    line (a config retried after its worker died, or put back unmeasured, keeps its place)."""
    return trial.system_attrs.get(ORDER, trial.number)


def requeue(study, trial) -> None:
    """Put ``trial``, a config popped from the queue and not measured, back as WAITING in its place: a new
    trial with its fixed params and order; ``trial`` itself is failed. (Failed alone, its config was gone
    for good: a resumed sweep enqueues its seeds with skip_if_exists, which a failed trial of the same
    params satisfies.)"""
    import optuna
    try:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    except optuna.exceptions.UpdateFinishedTrialError:
        return   # failed already by a worker that took it for dead; its retry is queued
    _queue_again(study, study._storage.get_trial(trial._trial_id))


def _queue_again(study, frozen, **attrs) -> None:
    """A WAITING copy of the finished trial ``frozen`` (its params, system attributes and order) with ``attrs``
    added; none of its user attributes (a worker's claim, host, pid)."""
    import optuna
    study.add_trial(optuna.create_trial(
        state=optuna.trial.TrialState.WAITING, params=frozen.params, distributions=frozen.distributions,
        system_attrs={**frozen.system_attrs, **attrs, ORDER: order_of(frozen)}))


def enqueue(study, params: dict) -> None:
    """Queue ``params`` unless a trial of the same params is waiting, running or complete. A failed one
    does not count (Optuna's skip_if_exists counts it): a config put back (``requeue``) or retried leaves
    a failed trial beside its waiting copy, and ``lab merge`` brings back the failed trial but not the
    waiting one (a worker that is gone queued it), so the next run would never queue that config again."""
    import optuna
    from lab.space import same_value
    states = (optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.COMPLETE)
    for t in trials(study, states):
        have = t.system_attrs.get("fixed_params", t.params)
        if have.keys() == params.keys() and all(same_value(have[k], v) for k, v in params.items()):
            return
    study.enqueue_trial(params)


def queued_ahead(study, trial) -> bool:
    """Whether a WAITING trial comes before ``trial`` (popped from the queue) by ``order_of``. Optuna pops
    the lowest trial number, but a retried or put-back config gets a new, higher number: its place is
    its order."""
    import optuna
    mine = order_of(study._storage.get_trial(trial._trial_id))
    return any(order_of(t) < mine for t in trials(study, (optuna.trial.TrialState.WAITING,)))


def retry_callback():
    """Callback that enqueues a dead worker's config again (at most MAX_RETRY times).

    As Optuna's RetryFailedTrialCallback (same ``failed_trial`` and ``retry_history`` system attributes),
    but the retry carries none of the dead trial's user attributes: with the dead worker's claim, host
    and pid, a retry popped by a live worker would look dead to a worker on that host that reads it
    between the new holder's identity writes (_recover_dead_trials), and be failed and retried again
    while its config is being measured."""
    def retry(study, trial) -> None:
        history = [*trial.system_attrs.get("retry_history", []), trial.number]
        if len(history) > MAX_RETRY:
            return
        # failed_trial names the line's first failed trial (a retry's own attribute is kept)
        _queue_again(study, trial, failed_trial=trial.system_attrs.get("failed_trial", trial.number),
                     retry_history=history)
    return retry


def storage_errors() -> tuple[type[BaseException], ...]:
    """What a storage that cannot be reached or opened raises."""
    try:
        from sqlalchemy.exc import SQLAlchemyError
    except ImportError:
        return ()
    return (SQLAlchemyError,)


def fresh_cache_env(home, env=None) -> dict:
    """``env`` (default os.environ) with every compile cache pointed into the empty folder ``home``: HOME
    and XDG_CACHE_HOME (where DSLs keep their caches by default), LAB_CACHE_DIR, and every *_CACHE_DIR
    variable already set. A sweep run with it compiles everything it measures, as on a new machine."""
    env = dict(os.environ if env is None else env)
    home = os.fspath(home)
    for name in [n for n in env if n.endswith("_CACHE_DIR")] + ["LAB_CACHE_DIR"]:
        env[name] = os.path.join(home, name.lower())
    env.update(HOME=home, XDG_CACHE_HOME=os.path.join(home, ".cache"))
    return env


def worker_identity(measures: bool = False) -> dict:
    """Host and GPU of this worker, recorded on its trials and rows: LAB_GPU_INDEX (set by --gpus), else
    the first index CUDA_VISIBLE_DEVICES names, else 0 for a worker that ``measures`` on a GPU (the CUDA
    default device), else none (compile-only)."""
    gpu = os.environ.get("LAB_GPU_INDEX")
    if gpu is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        gpu = visible.split(",")[0] if visible and visible.split(",")[0].isdigit() else None
        if gpu is None and measures and not visible:
            gpu = 0
    host = os.environ.get("LAB_HOST") or socket.gethostname()  # LAB_HOST: a name for a machine whose hostname says nothing
    return {"host": host, "gpu_index": int(gpu) if gpu is not None else None, "pid": os.getpid()}


def trials(study, states=None) -> list:
    """The study's trials as stored now, in trial-number order. Not ``study.get_trials``: Optuna's trial
    cache skips a trial of another worker that it first meets after a later-numbered one has finished.
    Sorted here because the RDB query has no ORDER BY: PostgreSQL returns updated rows in heap order,
    so two workers picking the first of equally fast trials could pick different ones (and each confirm
    its own "best": the shared-study test saw it on the loaded CI machine)."""
    storage = study._storage
    storage = getattr(storage, "_backend", storage)  # past optuna's _CachedStorage, to the RDB storage
    found = storage.get_all_trials(storage.get_study_id_from_name(study.study_name), deepcopy=False, states=states)
    return sorted(found, key=lambda t: t.number)


def _holders(study, key: str, but: int | None = None) -> list:
    """Trials other than number ``but`` that hold ``key``: claimed and running, or measured."""
    import optuna
    live = (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.COMPLETE)
    return [t for t in trials(study, live) if t.user_attrs.get("claim") == key and t.number != but
            and (t.state == optuna.trial.TrialState.RUNNING or t.user_attrs.get("measured"))]


def claim(study, trial, key: str):
    """None when ``trial`` now holds config ``key`` alone; else another trial that holds it (COMPLETE:
    measured, its value stands; RUNNING: another worker has it, or is claiming it right now)."""
    import optuna
    trial.set_user_attr("claim", key)
    # Yield to any other claim, whatever its number: two racing workers both wrote before they read,
    # so at least one sees the other (both may yield; the config stays free for a later proposal).
    return min(_holders(study, key, trial.number),
               key=lambda t: (t.state != optuna.trial.TrialState.COMPLETE, t.number), default=None)


def claim_alone(study, key: str, beats=None, attempts: int = 6, pause_s: tuple[float, float] = (0.05, 0.5)):
    """A new RUNNING trial of ``study`` that holds ``key`` alone, or None when another worker holds
    it or has done it. For a one-off task (the confirm) where ``claim``'s "both may yield" would leave
    it to nobody: a worker that yielded looks again after a random pause, and when no other claim of
    ``key`` is live or done by then (the other yielded too) it claims anew. A worker looks again only
    after its own claim has ended, so two yielded workers never both take the other for the owner.
    ``beats`` (Heartbeats) beats for the held trial; the caller tells it."""
    import optuna
    for _ in range(attempts):
        trial = study.ask()
        if beats is not None:
            beats.start(trial)
        owner = claim(study, trial, key)
        if owner is None:
            return trial
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        if beats is not None:
            beats.stop(trial)
        if owner.state == optuna.trial.TrialState.COMPLETE:
            return None
        time.sleep(random.uniform(*pause_s))
        if _holders(study, key):
            return None
    return None


def rank(study, trial) -> int:
    """Configs measured, plus those held (claimed, being measured) under lower trial numbers than
    ``trial``, read in one snapshot: ``trial`` fits in a budget of N trials when this is below N."""
    import optuna
    states = (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.COMPLETE)
    done, ahead = set(), 0
    for t in trials(study, states):
        if t.state == optuna.trial.TrialState.COMPLETE:
            if t.user_attrs.get("measured"):
                done.add(t.user_attrs.get("config_key"))
        elif t.number < trial.number and t.user_attrs.get("claim"):
            ahead += 1
    return len(done) + ahead


def fail_stale(study) -> None:
    """Fail the trials of workers that stopped beating (their configs are re-enqueued)."""
    import optuna
    optuna.storages.fail_stale_trials(study)


class Heartbeats:
    """One heartbeat thread per held trial: started when the trial is asked, stopped when told.

    Daemon threads of the lab's own, not Optuna's HeartbeatThread: a worker whose main thread fails
    must exit with its traceback, not hang on a non-daemon thread that beats forever."""

    def __init__(self, storage):
        from optuna.storages._heartbeat import is_heartbeat_enabled
        self.storage = storage
        self.interval = storage.get_heartbeat_interval() if is_heartbeat_enabled(storage) else None
        self.threads: dict[int, tuple[threading.Thread, threading.Event]] = {}

    def start(self, trial) -> None:
        if self.interval is None:
            return
        stop = threading.Event()

        def beat(trial_id=trial._trial_id):
            while True:
                try:
                    self.storage.record_heartbeat(trial_id)
                except Exception:  # noqa: BLE001 - one missed beat; the grace period spans several
                    pass
                if stop.wait(self.interval):
                    return
        t = threading.Thread(target=beat, daemon=True, name=f"lab-heartbeat-{trial.number}")
        t.start()
        self.threads[trial.number] = (t, stop)

    def stop(self, trial) -> None:
        held = self.threads.pop(trial.number, None)
        if held is not None:
            held[1].set()
            held[0].join()

    def stop_all(self) -> None:
        for number in list(self.threads):
            self.threads[number][1].set()
        for t, _ in self.threads.values():
            t.join()
        self.threads.clear()
