"""Bring what GPU calls wrote back into the checkout's results/ (``python -m lab merge PATH...``).

Each call of the lent machine starts from a copy of this checkout and returns its whole results/ folder
(scripts/device_run.sh packs it as results.tgz): untarring several calls' archives one over another
would keep only the last call's study databases. Merging instead:
  - run tables (``*.parquet``, one file per run id) are copied when absent; a local table that holds a
    subset of the incoming one's rows (the run went on in a later call) is replaced; any other
    difference is a conflict, left untouched and reported;
  - study databases (``optuna.db``, SQLite) take the incoming studies they lack and, in studies both
    have, the incoming finished trials they lack (matched by state, params, values and start time;
    trials still running or waiting belonged to a worker that is gone and are not copied, in a new
    study as in one both have);
  - the call's log (``log.txt`` beside results.tgz, with ``env.txt`` before it) goes to
    ``results/logs/<first run id>-log.txt``, or ``<call start>-call-log.txt`` when it names no run;
  - files that ``lab report`` / ``lab export`` and the notebook regenerate are skipped; other files are
    copied when absent, and a different one is a conflict.
"""
from __future__ import annotations

import filecmp
import re
import shutil
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from lab.devices import LabError

REGENERATED_DIRS, REGENERATED_FILES = ("report/", "tuned/"), ("analysis.ipynb",)
ROW_KEY = ["run_id", "phase", "trial", "kernel", "dsl", "shape", "config_json", "time_utc", "status"]


@dataclass
class Summary:
    copied: list[str] = field(default_factory=list)        # files new to the checkout
    replaced: list[str] = field(default_factory=list)      # run tables that grew
    studies: list[str] = field(default_factory=list)       # "<db>: <study> (n trials)" copied whole
    trials: list[str] = field(default_factory=list)        # "<db>: <study>: n trials" added
    n_trials: int = 0
    logs: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)       # regenerated files, unfinished trials
    conflicts: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"copied {p}" for p in self.copied] + [f"replaced {p} (its rows went on)" for p in self.replaced]
        out += [f"study {s}" for s in self.studies] + [f"trials {t}" for t in self.trials]
        out += [f"log {p}" for p in self.logs] + [f"skipped {p}" for p in self.skipped]
        return out + [f"CONFLICT {c}" for c in self.conflicts]


def _source(path: Path, tmp: Path) -> tuple[Path, Path | None]:
    """(results folder, the call's folder or None) of a results.tgz, a folder holding one, or a folder
    holding results/."""
    call = None
    if not path.exists():
        raise LabError(f"{path}: no such file or folder")
    if path.is_dir():
        call = path
        if (path / "results.tgz").exists():
            path = path / "results.tgz"
        elif (path / "results").is_dir():
            return path / "results", call
        else:
            raise LabError(f"{path}: neither results.tgz nor results/ in it")
    try:
        with tarfile.open(path) as tar:
            if hasattr(tarfile, "data_filter"):      # Python 3.11.4+: no paths outside tmp, no devices
                tar.extractall(tmp, filter="data")
            else:
                tar.extractall(tmp)
    except tarfile.TarError as exc:
        raise LabError(f"{path}: not a results archive ({str(exc).splitlines()[0]})") from None
    if not (tmp / "results").is_dir():
        raise LabError(f"{path}: the archive has no results/ folder")
    return tmp / "results", call


def _rows(path: Path) -> set[tuple]:
    df = pd.read_parquet(path)
    return set(df.reindex(columns=ROW_KEY).astype(str).itertuples(index=False, name=None))


def _merge_table(src: Path, dst: Path, rel: str, out: Summary) -> None:
    mine, theirs = _rows(dst), _rows(src)
    if theirs <= mine:
        return
    if mine < theirs:
        shutil.copy2(src, dst)
        out.replaced.append(rel)
    else:
        out.conflicts.append(f"{rel}: both copies have rows the other lacks")


def _trial_key(t) -> tuple:
    start = t.datetime_start.isoformat() if t.datetime_start else ""
    return (t.state.name, tuple(sorted((k, repr(v)) for k, v in t.params.items())), tuple(t.values or ()), start)


def merge_studies(src: Path, dst: Path, rel: str, out: Summary) -> None:
    """Add ``src``'s studies and finished trials that ``dst`` lacks (both SQLite Optuna storages)."""
    import optuna
    from optuna.trial import TrialState
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    s_url, d_url = f"sqlite:///{src}", f"sqlite:///{dst}"
    have = {s.study_name for s in optuna.get_all_study_summaries(d_url)}
    for summary in optuna.get_all_study_summaries(s_url):
        name = summary.study_name
        source = optuna.load_study(study_name=name, storage=s_url)
        if name in have:
            target = optuna.load_study(study_name=name, storage=d_url)
        else:
            # A study new here takes the same finished trials as one both have: a trial waiting there
            # (a seed that call queued and never ran) would run before the seeds a later run queues.
            target = optuna.create_study(study_name=name, storage=d_url, directions=source.directions)
            for key, value in source.user_attrs.items():
                target.set_user_attr(key, value)
        mine = {_trial_key(t) for t in target.get_trials(deepcopy=False)}
        new = [t for t in source.get_trials(deepcopy=False) if _trial_key(t) not in mine]
        done = [t for t in new if t.state in (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)]
        for t in done:
            target.add_trial(t)
        if name not in have:
            out.studies.append(f"{rel}: {name} ({len(done)} trials)")
        elif done:
            out.trials.append(f"{rel}: {name}: {len(done)} trials")
            out.n_trials += len(done)
        if len(new) > len(done):
            out.skipped.append(f"{rel}: {name}: {len(new) - len(done)} trials still running or waiting there")


def _save_log(call: Path, results: Path, out: Summary) -> None:
    log = call / "log.txt"
    if not log.exists():
        return
    text = log.read_text(errors="replace")
    env = call / "env.txt"
    head = env.read_text(errors="replace") if env.exists() else ""
    run = re.search(r"^run (\S+): rows in", text, re.M)
    if run:
        name = f"{run.group(1)}-log.txt"
    else:
        stamp = re.search(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)Z", head + text)
        if not stamp:
            out.skipped.append(f"{log}: names no run and no time")
            return
        name = "{}{}{}T{}{}{}Z-call-log.txt".format(*stamp.groups())
    dst = results / "logs" / name
    if dst.exists():
        if dst.read_text(errors="replace") != head + text:
            out.conflicts.append(f"logs/{name}: exists with other content")
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(head + text)
    out.logs.append(f"logs/{name}")


def merge(paths: list[Path], results: Path) -> Summary:
    """Merge each call's output (``paths``, in the order given) into the ``results`` folder."""
    out, regenerated = Summary(), 0
    for path in paths:
        with tempfile.TemporaryDirectory() as tmp:
            src_root, call = _source(Path(path), Path(tmp))
            for src in sorted(p for p in src_root.rglob("*") if p.is_file()):
                rel = src.relative_to(src_root).as_posix()
                dst = results / rel
                if rel.startswith(REGENERATED_DIRS) or rel in REGENERATED_FILES:
                    regenerated += dst.exists() and not filecmp.cmp(src, dst, shallow=False)
                    continue
                if not dst.exists():
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, dst)
                    out.copied.append(rel)
                elif filecmp.cmp(src, dst, shallow=False):
                    continue
                elif src.suffix == ".parquet":
                    _merge_table(src, dst, rel, out)
                elif src.name.endswith(".db"):
                    merge_studies(src, dst, rel, out)
                else:
                    out.conflicts.append(f"{rel}: differs from the checkout's copy")
            if call is not None:
                _save_log(call, results, out)
    if regenerated:
        out.skipped.append(f"{regenerated} files of report/, tuned/ and the notebook (lab report, lab export and "
                           f"the notebook regenerate them)")
    return out
