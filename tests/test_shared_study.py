"""Several sweep worker processes on one study. Against PostgreSQL when LAB_TEST_PG_URL names a
server (.ci/run starts one with scripts/pg_start.sh), else against SQLite in a temporary folder:
the claims (no config measured twice), a killed worker's trial retried by the others, the confirm
run once, every row naming its host and GPU."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from lab import study as lab_study
from lab.results import load
from tests.conftest import load_script

SPACE = '[params]\nMODE = ["ok", "slow"]\nSMEM_KB = [16, 32, 48, 64]\nSPEED = [1, 2, 3]\nESTIMATE_BIAS_KB = [0]\n'


@pytest.fixture
def storage(tmp_path):
    """A fresh database per test (studies are found by name: a leftover one would be resumed)."""
    server = os.environ.get("LAB_TEST_PG_URL")
    if not server:
        yield f"sqlite:///{tmp_path / 'shared.db'}"
        return
    name = f"lab_{uuid.uuid4().hex[:12]}"
    yield lab_study.create_database(server, name)
    lab_study.drop_database(server, name)


# A worker silent this long is taken for dead (the kill test; the default is 120 s): far above the 1 s
# heartbeat, so a live worker on the loaded 2-core CI machine is never taken for dead.
GRACE_S = 12


def _worker(lab_env, storage, gpu: int, trials: int, delay_s: float, dsls: str = "sim,torch", grace=False,
            host=None):
    env = {**os.environ, "LAB_GPU_INDEX": str(gpu), "LAB_HEARTBEAT_S": "1"}
    if host:
        env["LAB_HOST"] = host
    if grace:
        env["LAB_GRACE_S"] = str(GRACE_S)
    return subprocess.Popen([sys.executable, "-m", "tests.shared_worker", storage,
                             str(lab_env.results), str(trials), str(delay_s), dsls], env=env, cwd=lab_env.root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs, timeout_s=240):
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout_s)
        assert p.returncode == 0, out[-3000:]
        outs.append(out)
    return outs


def _sim_study(storage):
    import optuna
    names = [s.study_name for s in optuna.get_all_study_summaries(storage) if s.study_name.startswith("gemm|sim|")]
    assert len(names) == 1, names
    return optuna.load_study(study_name=names[0], storage=storage)


def test_three_workers_share_one_study_without_measuring_a_config_twice(lab_env, storage):
    (lab_env.sweeps / "gemm" / "sim.toml").write_text(SPACE)
    outs = _finish([_worker(lab_env, storage, gpu, 12, 0.5) for gpu in range(3)])
    rows = load(lab_env.results)
    sweep = rows[rows["phase"] == "sweep"]
    sim = sweep[sweep["dsl"] == "sim"]
    assert len(sim) == 12 and sim["config_json"].is_unique, sim["config_json"].value_counts().head()
    assert len(sweep[sweep["dsl"] == "torch"]) == 1  # its one config, measured by one worker
    assert sweep["run_id"].nunique() >= 2, "\n".join(outs)  # the work was shared
    assert set(rows["gpu_index"].dropna().astype(int)) <= {0, 1, 2} and rows["host"].notna().all()
    confirm = rows[rows["phase"] == "confirm"]
    assert sorted(confirm["dsl"]) == ["sim", "torch"], "\n".join(outs)[-3000:]  # once, by one worker
    assert confirm["run_id"].nunique() == 1


def test_a_killed_workers_trial_is_retried_and_no_finished_trial_is_lost(lab_env, storage):
    import optuna
    (lab_env.sweeps / "gemm" / "sim.toml").write_text(SPACE)
    # Its trials never finish; on "another machine", so only its silence (the heartbeat) tells it died.
    victim = _worker(lab_env, storage, 2, 24, 600.0, "sim", grace=True, host="elsewhere")
    deadline, held = time.time() + 120, None
    while time.time() < deadline and held is None:
        time.sleep(0.5)
        try:
            running = _sim_study(storage).get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        except (AssertionError, KeyError, ValueError):
            continue
        held = next((t for t in running if t.user_attrs.get("claim") and t.user_attrs.get("pid") == victim.pid), None)
    assert held is not None, "the victim never held a trial"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    time.sleep(GRACE_S + 1)  # its heartbeat is stale now: the next workers fail its trial and retry the config
    outs = _finish([_worker(lab_env, storage, gpu, 24, 0.05, "sim", grace=True) for gpu in range(2)])
    rows = load(lab_env.results)
    sim = rows[(rows["phase"] == "sweep") & (rows["dsl"] == "sim")]
    twice = sim[sim["config_json"].duplicated(keep=False)][["run_id", "trial", "config_json"]]
    # the whole space, each config once
    assert len(sim) == 24 and twice.empty, f"{len(sim)} rows; twice:\n{twice}\n" + "\n".join(outs)[-3000:]
    assert set(sim["gpu_index"].astype(int)) <= {0, 1} and "elsewhere" not in set(sim["host"])  # the victim: no row
    study = _sim_study(storage)
    dead = study.trials[held.number]
    assert dead.state == optuna.trial.TrialState.FAIL
    retried = [t for t in study.trials if t.system_attrs.get("failed_trial") == held.number]
    # SQLite has no row locks: two workers can both fail the stale trial and each enqueue a retry (the
    # claims still measure the config once, asserted above); PostgreSQL's row lock lets one of them.
    assert retried and all(t.params == held.params for t in retried)
    assert len(retried) == 1 or not storage.startswith("postgresql"), [t.number for t in retried]
    assert json.dumps({**held.params}, sort_keys=True) in set(
        json.dumps({k: v for k, v in json.loads(c).items() if k in held.params}, sort_keys=True)
        for c in sim["config_json"])


def test_a_retry_carries_none_of_the_dead_workers_tags(lab_env, storage):
    """A dead trial's retry, popped by a live worker that has written its host but not yet its pid, is
    not taken for dead by a worker on that host (it was, when the retry inherited the dead worker's pid:
    the live worker measured the config and so did the retry of its failed trial). At most MAX_RETRY
    retries of one config."""
    import optuna
    from lab import sweep
    host = lab_study.worker_identity()["host"]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    st = lab_study.open_storage(storage)
    study = optuna.create_study(storage=st, study_name="retry")
    dead = study.ask({"X": optuna.distributions.CategoricalDistribution([1, 2])})
    for k, v in {"host": host, "gpu_index": 0, "pid": gone.pid, "claim": "X=1"}.items():
        dead.set_user_attr(k, v)
    sweep._recover_dead_trials(study, lab_env.results)  # no row: failed, its config enqueued again
    assert study.trials[dead.number].state == optuna.trial.TrialState.FAIL
    retry = study.ask()
    assert retry.params == dead.params and retry.number != dead.number
    retry.set_user_attr("host", host)  # the live worker's first identity write
    sweep._recover_dead_trials(study, lab_env.results)
    assert study.trials[retry.number].state == optuna.trial.TrialState.RUNNING
    assert study.trials[retry.number].user_attrs == {"host": host}  # none of the dead worker's tags
    retry.set_user_attr("pid", gone.pid)  # now it does look dead (its worker "died" too): retried once more
    sweep._recover_dead_trials(study, lab_env.results)
    again = study.ask()
    assert again.params == dead.params
    assert study.trials[again.number].system_attrs["retry_history"] == [dead.number, retry.number]
    again.set_user_attr("host", host)
    again.set_user_attr("pid", gone.pid)
    sweep._recover_dead_trials(study, lab_env.results)
    assert not study.get_trials(states=(optuna.trial.TrialState.WAITING,))  # MAX_RETRY reached


class _TakenForDead:
    """A runner during whose first trial another worker takes every trial this one holds for dead
    (Optuna fails them, as fail_stale_trials does): the worker must go on, not raise or hang."""

    def __init__(self, storage):
        from tests.test_sweep_engine import SimRunner
        self.sim, self.storage, self.failed = SimRunner(), storage, []

    def run(self, task, timeout_s):
        import optuna
        if not self.failed:
            study = _sim_study(self.storage)
            for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
                study._storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
                self.failed.append(t.number)
        return self.sim.run(task, timeout_s)

    def close(self):
        pass


def test_a_worker_whose_trials_were_taken_for_dead_goes_on_and_keeps_its_rows(lab_env, storage):
    import threading
    from lab import sweep
    from tests.test_sweep_engine import FAST_TIMING, present_h100
    (lab_env.sweeps / "gemm" / "sim.toml").write_text(SPACE)
    runner, said = _TakenForDead(storage), []
    req = sweep.SweepRequest(kernel="gemm", device="h100", dsls=["sim"], shapes=["tiny"], trials=6,
                             results_dir=lab_env.results, sampler="random", seed=3, storage=storage, baseline=False,
                             confirm=False, progress=False, prefetch=2, timing=FAST_TIMING, timeout_s=60.0)
    sweep.run(req, present_h100(), runner=runner, out=said.append)
    assert len(runner.failed) == 3, runner.failed  # the measured trial and the two prefetched
    assert any("taken for dead" in line for line in said), said
    sim = load(lab_env.results)
    assert len(sim) == 6 and sim["status"].eq("ok").all()  # the taken trial's row stays; the sweep went on
    assert not [t for t in threading.enumerate() if t.name.startswith("lab-heartbeat")]


def test_a_worker_whose_loop_fails_stops_beating(lab_env, storage):
    """A worker that raises stops its heartbeats (daemon threads besides): another worker then retries
    its trial, and the process exits with its traceback instead of hanging on a beating thread."""
    import threading
    from lab import sweep
    from tests.test_sweep_engine import FAST_TIMING, present_h100

    class Broken:
        def run(self, task, timeout_s):
            raise RuntimeError("runner broke")

        def close(self):
            pass
    (lab_env.sweeps / "gemm" / "sim.toml").write_text(SPACE)
    req = sweep.SweepRequest(kernel="gemm", device="h100", dsls=["sim"], shapes=["tiny"], trials=6,
                             results_dir=lab_env.results, sampler="random", seed=3, storage=storage, baseline=False,
                             confirm=False, progress=False, prefetch=1, timing=FAST_TIMING, timeout_s=60.0)
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="runner broke"):
        sweep.run(req, present_h100(), runner=Broken(), out=lambda line: None)
    time.sleep(0.5)
    left = [t.name for t in threading.enumerate() if t not in before and not t.daemon]
    assert not left, left  # the interpreter would wait for these at exit
    assert not [t for t in threading.enumerate() if t.name.startswith("lab-heartbeat")]


def _demo():
    return load_script("shared_study_demo")


def test_demo_compare_finds_duplicates_gaps_and_status_changes():
    """scripts/shared_study_demo.py's verdict on a one-worker and a several-worker run of one grid."""
    import pandas as pd
    demo = _demo()
    same_lane = {"phase": "sweep", "kernel": "gemm", "dsl": "triton", "shape": "s"}
    one = pd.DataFrame({"config_json": ["a", "b", "c"], "status": ["ok", "ok", "compile_error"],
                        "time_ms": [2.0, 1.0, float("nan")]}).assign(**same_lane)
    same = demo.compare(one, one.iloc[[2, 0, 1]])
    assert not (same["only_one"] or same["only_many"] or same["twice"] or same["status_differs"])
    assert same["best_one"] == same["best_many"] == "b"
    # "e": rejected by each worker's preflight, twice, which is not measuring it twice
    many = pd.DataFrame({"config_json": ["a", "a", "c", "d", "e", "e"],
                         "status": ["ok", "ok", "ok", "ok", "infeasible", "infeasible"],
                         "time_ms": [2.0, 2.1, 0.5, 3.0, float("nan"), float("nan")]}).assign(**same_lane)
    res = demo.compare(one, many)
    assert res["only_one"] == ["b"] and res["only_many"] == ["d", "e"] and res["twice"] == 1
    assert res["status_differs"] == ["c"] and res["best_many"] == "c"


@pytest.mark.skipif(not os.environ.get("LAB_TEST_PG_URL"), reason="needs a PostgreSQL server (.ci/run starts one)")
def test_create_database_replaces_an_existing_one():
    import sqlalchemy as sa
    server = os.environ["LAB_TEST_PG_URL"]
    name = f"lab_{uuid.uuid4().hex[:12]}"
    url = lab_study.create_database(server, name)
    eng = sa.create_engine(url)
    with eng.begin() as c:
        c.execute(sa.text("CREATE TABLE t (x int)"))
    eng.dispose()
    url2 = lab_study.create_database(server, name)  # dropped and created again: the table is gone
    assert url2 == url
    eng = sa.create_engine(url)
    with eng.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM pg_tables WHERE tablename = 't'")).scalar() == 0
    eng.dispose()
    lab_study.drop_database(server, name)


@pytest.mark.parametrize("grid", ["triton_gemm", "tilelang_gemm"])
def test_demo_grids_are_spaces_of_their_lanes(tmp_path, monkeypatch, grid):
    """The demo's grids parse as sweep files of their lanes, and at least 12 of their configs pass the
    preflight's cheap checks for the H100 at the demo's shape (the TileLang one: all 16)."""
    import shutil
    from pathlib import Path
    from lab import preflight, registry, space
    from lab.devices import get_profile
    dsl, kernel = grid.split("_")
    root = Path(__file__).resolve().parent.parent
    sweeps = tmp_path / "sweeps"
    shutil.copytree(root / "sweeps", sweeps)
    shutil.copy(root / "scripts" / "demo_grids" / f"{grid}.toml", sweeps / kernel / f"{dsl}.toml")
    monkeypatch.setenv("LAB_SWEEPS_DIR", str(sweeps))
    lane = registry.get(dsl, kernel)
    sp = space.load_space(kernel, dsl, tuple(lane.module.TUNABLES), None)
    shape = space.load_shapes(kernel)[0]["sq4096_bf16"]
    ok = [c for c in sp.configs() if preflight.cheap_checks(lane, sp, lane.full_config(c), shape,
                                                             get_profile("h100")).feasible]
    assert len(ok) >= 12 and (dsl != "tilelang" or len(ok) == sp.size == 16)


def test_fresh_cache_env_points_every_compile_cache_into_the_folder(tmp_path):
    """Both demo runs (and each multi-GPU run) compile everything: HOME, XDG_CACHE_HOME, LAB_CACHE_DIR and
    any *_CACHE_DIR already set (a DSL's) move into the fresh folder; other variables stay."""
    from lab import study
    env = study.fresh_cache_env(tmp_path, {"HOME": "/root", "SOME_CACHE_DIR": "/var/c", "PATH": "/bin"})
    assert env["HOME"] == str(tmp_path) and env["PATH"] == "/bin"
    for name in ("XDG_CACHE_HOME", "LAB_CACHE_DIR", "SOME_CACHE_DIR"):
        assert env[name].startswith(str(tmp_path) + "/"), (name, env[name])
    assert len({env["LAB_CACHE_DIR"], env["SOME_CACHE_DIR"], env["XDG_CACHE_HOME"]}) == 3


def _claims_study(storage):
    import optuna
    return optuna.create_study(storage=lab_study.open_storage(storage), study_name="confirm-claims")


def test_a_confirm_both_workers_yielded_is_claimed_again_not_left_to_nobody(storage):
    """The race behind the flaky confirm: two workers claim the one confirm at once, each sees the
    other and yields. The one that looks again after the other's claim ended takes it."""
    import threading
    import optuna
    study = _claims_study(storage)
    other = study.ask()
    other.set_user_attr("claim", "confirm-key")          # the other worker's claim, live when we read
    yielded = threading.Timer(0.1, lambda: study.tell(other, state=optuna.trial.TrialState.FAIL))
    yielded.start()                                      # ... and it yields too, before we look again
    trial = lab_study.claim_alone(study, "confirm-key", pause_s=(0.4, 0.4))
    yielded.join()
    assert trial is not None and trial.number != other.number
    assert trial.user_attrs["claim"] == "confirm-key"


def test_a_confirm_held_or_done_by_another_worker_is_not_claimed(storage):
    study = _claims_study(storage)
    other = study.ask()
    other.set_user_attr("claim", "held")                 # live all along: that worker confirms
    assert lab_study.claim_alone(study, "held", pause_s=(0.0, 0.01)) is None
    done = study.ask()
    done.set_user_attr("claim", "done")
    done.set_user_attr("measured", True)
    study.tell(done, 0.0)
    assert lab_study.claim_alone(study, "done", pause_s=(0.0, 0.01)) is None
    assert lab_study.claim_alone(study, "free", pause_s=(0.0, 0.01)) is not None


def test_racing_workers_claim_a_confirm_exactly_once(storage):
    import threading
    study = _claims_study(storage)
    for round_ in range(4):
        won, start = [], threading.Barrier(3)

        def worker():
            start.wait()
            if lab_study.claim_alone(study, f"key-{round_}", pause_s=(0.01, 0.2)) is not None:
                won.append(1)
        threads = [threading.Thread(target=worker) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1, (round_, won)


def test_trials_come_in_trial_number_order_whatever_order_the_storage_returns():
    """PostgreSQL hands back updated rows in heap order; workers that break ties between equally fast
    trials by list position must all see the same list (else each confirms a different "best")."""
    from types import SimpleNamespace
    stored = [SimpleNamespace(number=n, value=1.0) for n in (3, 0, 2, 1)]
    storage = SimpleNamespace(get_study_id_from_name=lambda name: 7,
                              get_all_trials=lambda sid, deepcopy, states: list(stored))
    study = SimpleNamespace(_storage=storage, study_name="gemm|sim|tiny")
    got = lab_study.trials(study)
    assert [t.number for t in got] == [0, 1, 2, 3]
    assert min(got, key=lambda t: t.value).number == 0
