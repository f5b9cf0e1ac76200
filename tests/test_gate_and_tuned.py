"""The re-sweep gate, lane identities and the tuned-config export, on fixture result tables.

Each test builds a throwaway git repository holding two toy lanes of the gemm kernel (DSLs "toy" and
"toy2", both importing a helper), writes result rows measured at its first commit, then edits the
repository the way a change would."""
from __future__ import annotations

import ast

import json
import subprocess
import sys
import textwrap

import pandas as pd
import pytest

import lab
from lab import gate, identity, registry, results, tuned
from lab.devices import LabError

LANE = '''"""A toy lane {name}."""
from gatepkg.{dsl} import _helper

DSL = "{dsl}"
KERNEL = "gemm"
TUNABLES = ("BLOCK",)
DEFAULTS = {{"BLOCK": 64}}


def config_reason(config, shape):
    return None


def eligibility(target):
    return None


def target_reason(config, target):
    return None


def smem_estimate(config, shape, target):
    return _helper.smem(config)


def compile_for(config, shape, target):
    raise NotImplementedError


def build(config, shape):
    raise NotImplementedError


def versions():
    return {{"toolkit": "1.0"}}
'''
HELPER = '''def smem(config):
    return config["BLOCK"] * 1024  # bytes
'''
PYPROJECT = '[project]\nname = "fixture"\ndependencies = ["toolkit==1.0", "torch>=2"]\n'


def _git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def _default_shapes(lab_env, names):
    path = lab_env.sweeps / "gemm" / "shapes.toml"
    text = path.read_text()
    first = text.index("\ndefault = ")
    end = text.index("\n", first + 1)
    path.write_text(text[:first] + "\ndefault = " + json.dumps(names) + text[end:])


@pytest.fixture
def repo(tmp_path, monkeypatch, lab_env):
    root = tmp_path / "repo"
    for dsl in ("toy", "toy2"):
        d = root / "gatepkg" / dsl
        d.mkdir(parents=True)
        (d / "__init__.py").write_text("")
        (d / "gemm.py").write_text(LANE.format(dsl=dsl, name=dsl))
        (d / "_helper.py").write_text(HELPER)
    (root / "gatepkg" / "__init__.py").write_text("")
    (root / "lab").mkdir()
    (root / "lab" / "__init__.py").write_text(f'__version__ = "{lab.__version__}"\n')
    (root / "pyproject.toml").write_text(PYPROJECT)
    _git(root, "init", "-q")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "first")
    (lab_env.sweeps / "gate.toml").write_text('[required]\ndefault = []\ngemm = ["h100"]\n')
    _default_shapes(lab_env, ["sq4096_bf16"])   # the toy lanes are measured at this one shape
    monkeypatch.setattr(identity, "ROOT", root)
    monkeypatch.setenv("LAB_KERNEL_PACKAGES", "gatepkg")
    monkeypatch.syspath_prepend(str(root))
    for name in [m for m in sys.modules if m.startswith("gatepkg")]:
        monkeypatch.delitem(sys.modules, name)
    registry._LANES.clear()
    gate._identity_at.cache_clear()

    class Repo:
        path = root
        head = _git(root, "rev-parse", "HEAD")
        results = lab_env.results

        @staticmethod
        def commit(msg="change"):
            _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", msg)
            return _git(root, "rev-parse", "HEAD")
    yield Repo
    registry._LANES.clear()


def _row(dsl, *, device="h100", shape="sq4096_bf16", ms=1.0, phase="sweep", commit="", legacy=False,
         config=None, emulated=False, time_utc="2026-11-24T10:00:00Z", status="ok"):
    versions = {"lab": lab.__version__, "toolkit": "1.0"}
    size = 8192 if "8192" in shape else 4096
    if not legacy:
        versions.update(identity.lane_identity(f"gatepkg.{dsl}.gemm"))
    row = {c: None for c in results.COLUMNS}
    row.update(run_id=f"run-{dsl}-{device}", time_utc=time_utc, git_commit=commit, git_dirty=False, kernel="gemm",
               dsl=dsl, baseline=False, shape=shape, shape_json=json.dumps({**dict.fromkeys("MNK", size),
                                                                            "dtype": "bfloat16"}),
               dtype="bfloat16", config_json=json.dumps(config or {"BLOCK": 64}), phase=phase, trial=0,
               requested_profile=device, actual_gpu="NVIDIA H100 80GB HBM3", actual_profile="h100",
               compile_target="sm_90a", emulated=emulated, compile_only=False, status=status, time_ms=ms,
               parity_rel_l2=1e-3, versions_json=json.dumps(versions), samples_ms=[ms])
    return row


def _write(repo, rows):
    w = results.RunWriter(repo.results / "h100" / "gemm", f"fixture-{len(list(repo.results.rglob('*.parquet')))}")
    for r in rows:
        w.add(r)
    return results.load(repo.results)


def _entries(df, **kw):
    return {(e.dsl, e.device): e for e in gate.evaluate(df, dsls=["toy", "toy2"], **kw)}


def _gate_cli(repo, *extra):
    from lab.cli import main
    return main(["gate", "--dsl", "toy", "toy2", "--results", str(repo.results), *extra])


def test_code_hash_does_not_depend_on_the_python_version():
    """Fields a newer Python adds (empty, like 3.12's FunctionDef.type_params) leave the hash alone."""
    tree = ast.parse("def f(x):\n    return x + 1\n")
    before = identity.canonical(tree)
    tree.body[0].type_params = []
    tree.body[0]._fields = (*tree.body[0]._fields, "type_params")
    assert identity.canonical(tree) == before and "type_params" not in before and "None" not in before


def test_rows_of_an_older_hash_scheme_are_judged_at_their_commit(monkeypatch):
    recorded = {"lab": "0", "lane_code": "x", "lane_files": {"kernels/a.py": "old-scheme"}}
    monkeypatch.setattr(gate, "_identity_at", lambda module, commit: {"lane_code": "y", "lane_files": {"kernels/a.py": commit}})
    assert gate.measured_identity("m", recorded, "abc", False)["lane_files"] == {"kernels/a.py": "abc"}
    assert gate.measured_identity("m", recorded, "abc", True)["lane_files"] == {"kernels/a.py": "old-scheme"}
    assert gate.measured_identity("m", {**recorded, "lane_hash": identity.SCHEME}, "abc", False)["lane_files"] == \
        {"kernels/a.py": "old-scheme"}


def test_code_hash_ignores_docstrings_and_comments_only():
    base = 'def f(x):\n    """Doc."""\n    return x + 1  # one\n'
    assert identity.code_hash(base) == identity.code_hash('def f(x):\n    """Other words."""\n    return x + 1\n')
    assert identity.code_hash(base) != identity.code_hash('def f(x):\n    """Doc."""\n    return x + 2\n')


def test_identity_follows_the_kernel_modules_a_lane_imports(repo):
    files = identity.lane_identity("gatepkg.toy.gemm")["lane_files"]
    assert set(files) == {"gatepkg/__init__.py", "gatepkg/toy/__init__.py", "gatepkg/toy/gemm.py",
                          "gatepkg/toy/_helper.py"}
    # The real lanes: the Triton M2RNN lane's shared helper and the CuTe DSL lanes' AOT helper count.
    monkeypatch_root = identity.ROOT
    assert monkeypatch_root == repo.path


def test_real_lanes_hash_their_helpers():
    real = identity.ROOT
    assert (real / "kernels").is_dir()
    assert "kernels/triton/_m2rnn.py" in identity.lane_identity("kernels.triton.m2rnn_fwd")["lane_files"]
    assert "kernels/cute/_aot.py" in identity.lane_identity("kernels.cute.m2rnn_bwd")["lane_files"]
    assert "kernels/cutile/gemm.py" in identity.lane_identity("kernels.cutile.m2rnn_bwd")["lane_files"]


def test_gate_fresh_then_docstring_edit_stays_fresh(repo, capsys):
    df = _write(repo, [_row("toy", commit=repo.head), _row("toy2", commit=repo.head)])
    e = _entries(df)
    assert e[("toy", "h100")].status == "fresh" and e[("toy2", "h100")].status == "fresh"
    lane = repo.path / "gatepkg" / "toy" / "gemm.py"
    lane.write_text(lane.read_text().replace('"""A toy lane toy."""', '"""Reworded."""  # and a comment'))
    assert _entries(df)[("toy", "h100")].status == "fresh"
    assert _gate_cli(repo) == 0
    assert "2 fresh, 0 stale" in capsys.readouterr().out


def test_gate_changed_helper_is_stale_with_the_command(repo, capsys):
    df = _write(repo, [_row("toy", commit=repo.head), _row("toy2", commit=repo.head)])
    helper = repo.path / "gatepkg" / "toy" / "_helper.py"
    helper.write_text(HELPER.replace("1024", "2048"))
    e = _entries(df)[("toy", "h100")]
    assert e.status == "stale" and e.failing
    assert "lane code gatepkg/toy/_helper.py" in e.changes[0]
    assert e.command() == "python -m lab sweep gemm --device h100 --dsl toy --shape sq4096_bf16"
    assert _entries(df)[("toy2", "h100")].status == "fresh"
    assert _gate_cli(repo) == 1
    out = capsys.readouterr().out
    assert "stale: lane code gatepkg/toy/_helper.py" in out and "->  python -m lab sweep gemm" in out


def test_a_newer_row_of_other_code_leaves_the_checkouts_rows_fresh(repo):
    """A branch measured beside the checkout (LAB_BRANCH) writes newer rows of other code: the shape stays
    fresh while a row of the checkout's code exists, and turns stale when none does."""
    branch = _row("toy", commit=repo.head, time_utc="2026-11-25T10:00:00Z")
    versions = json.loads(branch["versions_json"])
    versions["lane_files"] = {**versions["lane_files"], "gatepkg/toy/gemm.py": "a-branch's-code"}
    branch["versions_json"] = json.dumps(versions)
    df = _write(repo, [_row("toy", commit=repo.head), branch])
    assert _entries(df)[("toy", "h100")].status == "fresh"
    only_branch = _write(repo, [branch])
    e = _entries(only_branch[only_branch["time_utc"] == "2026-11-25T10:00:00Z"])[("toy", "h100")]
    assert e.status == "stale" and "lane code gatepkg/toy/gemm.py" in e.changes[0]


def test_a_change_refreshed_without_an_ab_is_listed_with_the_gate_run_that_judges_it(repo, capsys):
    """A shape re-measured at changed code by a plain sweep is fresh, but no A/B compared it with the
    previous best's code (TileLang M2RNN, 2026-11-27: sweeps of one seed after a code change, 1-3% off
    the earlier bests with no verdict): the line names those shapes and the `gate --run` that judges them;
    an A/B row of today's code (phase gate_checkout) clears it."""
    old = _row("toy", commit=repo.head)
    versions = json.loads(old["versions_json"])
    versions["lane_files"] = {**versions["lane_files"], "gatepkg/toy/gemm.py": "earlier-code"}
    old["versions_json"] = json.dumps(versions)
    new = _row("toy", commit=repo.head, time_utc="2026-11-25T10:00:00Z")
    df = _write(repo, [old, new, _row("toy2", commit=repo.head)])
    e = _entries(df)[("toy", "h100")]
    assert e.status == "fresh" and not e.failing and e.unjudged == ["sq4096_bf16"]
    assert e.line().endswith("fresh (no gate --run A/B of this code at sq4096_bf16)  ->  python -m lab gate --run "
                             "--device h100 --kernel gemm --dsl toy --shape sq4096_bf16")
    assert _entries(df)[("toy2", "h100")].unjudged == []           # never measured with other code
    ab = {**new, "phase": "gate_checkout", "study": "gate SAME", "time_utc": "2026-11-25T11:00:00Z"}
    assert _entries(_write(repo, [ab]))[("toy", "h100")].unjudged == []
    assert _gate_cli(repo) == 0


def test_gate_changed_toolchain_pin_and_harness(repo):
    df = _write(repo, [_row("toy", commit=repo.head)])
    (repo.path / "pyproject.toml").write_text(PYPROJECT.replace("toolkit==1.0", "toolkit==1.1"))
    e = _entries(df)[("toy", "h100")]
    assert e.status == "stale" and "toolkit 1.0 -> 1.1" in e.changes
    old = _row("toy", commit=repo.head)
    old["versions_json"] = json.dumps({**json.loads(old["versions_json"]), "lab": "0.0.1"})
    (repo.path / "pyproject.toml").write_text(PYPROJECT)
    both = _write(repo, [{**old, "time_utc": "2026-11-25T00:00:00Z"}])
    e = _entries(both[both["time_utc"] == "2026-11-25T00:00:00Z"])[("toy", "h100")]
    assert e.status == "stale" and f"harness 0.0.1 -> {lab.__version__}" in e.changes


def test_gate_device_never_measured_and_emulated_command(repo, lab_env):
    (lab_env.sweeps / "gate.toml").write_text('[required]\ndefault = []\ngemm = ["h100", "gb10"]\n')
    df = _write(repo, [_row("toy", commit=repo.head), _row("toy", commit=repo.head, device="gb10", emulated=True)])
    e = _entries(df)
    assert e[("toy2", "gb10")].status == "never measured" and e[("toy2", "gb10")].failing
    assert e[("toy", "gb10")].status == "fresh"
    (repo.path / "gatepkg" / "toy" / "_helper.py").write_text(HELPER.replace("1024", "4096"))
    assert _entries(df)[("toy", "gb10")].command().endswith("--emulate")
    # A device nobody requires and nobody measured is not listed; failed rows do not count as measured.
    df = _write(repo, [_row("toy2", commit=repo.head, device="h200", status="wrong_result")])
    assert ("toy2", "h200") not in _entries(df)


def test_gate_default_shape_never_measured_is_stale_until_tried(repo, lab_env):
    """A required lane measured at one default shape is not fresh at another where it has no ok row: failed
    trials (a run stopped after one infeasible config) leave the shape untried; a refusal of the whole
    lane there (phase space / eligibility: it cannot run that shape, with the reason) counts as tried."""
    _default_shapes(lab_env, ["sq4096_bf16", "sq8192_bf16"])
    df = _write(repo, [_row("toy", commit=repo.head)])
    e = _entries(df)[("toy", "h100")]
    assert e.status == "stale" and e.failing and e.stale_shapes == ["sq8192_bf16"]
    assert e.changes == ["default shapes with no ok row sq8192_bf16"]
    assert e.command() == "python -m lab sweep gemm --device h100 --dsl toy --shape sq8192_bf16"
    df = _write(repo, [_row("toy", commit=repo.head),
                       _row("toy", commit=repo.head, shape="sq8192_bf16", status="infeasible")])
    assert _entries(df)[("toy", "h100")].stale_shapes == ["sq8192_bf16"]
    df = _write(repo, [_row("toy", commit=repo.head),
                       _row("toy", commit=repo.head, shape="sq8192_bf16", status="infeasible", phase="space")])
    assert _entries(df)[("toy", "h100")].status == "fresh"


def test_reference_lanes_are_listed_but_never_required(lab_env):
    # The real torch M2RNN lanes are fp32 reference loops (BASELINE_KIND "reference").
    registry._LANES.clear()
    rows = [_row("toy", shape="b2_n8")]
    rows[0].update(kernel="m2rnn_fwd", dsl="torch", versions_json=json.dumps({"lab": "0.0.0"}))
    w = results.RunWriter(lab_env.results / "h100" / "m2rnn_fwd", "ref")
    w.add(rows[0])
    (lab_env.sweeps / "gate.toml").write_text('[required]\ndefault = ["h100"]\n')
    entries = gate.evaluate(results.load(lab_env.results), kernels=["m2rnn_fwd", "gemm"], dsls=["torch"])
    ref = {(e.kernel, e.device): e for e in entries}
    assert ref[("m2rnn_fwd", "h100")].reference and ref[("m2rnn_fwd", "h100")].status == "stale"
    assert not ref[("m2rnn_fwd", "h100")].failing and "[reference]" in ref[("m2rnn_fwd", "h100")].line()
    assert ref[("gemm", "h100")].required and ref[("gemm", "h100")].status == "never measured"


def test_gate_legacy_rows_judged_by_the_identity_at_their_commit(repo):
    df = _write(repo, [_row("toy", commit=repo.head, legacy=True), _row("toy2", commit="", legacy=True)])
    e = _entries(df)
    assert e[("toy", "h100")].status == "fresh"
    assert e[("toy2", "h100")].status == "stale" and "no identity recorded" in e[("toy2", "h100")].changes[0]
    lane = repo.path / "gatepkg" / "toy" / "gemm.py"
    lane.write_text(lane.read_text().replace("return None\n\n\ndef eligibility", "return 'no'\n\n\ndef eligibility"))
    assert _entries(df)[("toy", "h100")].status == "stale"


def test_gate_base_requires_only_the_lanes_the_branch_touched(repo, capsys):
    first = repo.head
    df = _write(repo, [_row("toy", commit=first), _row("toy2", commit=first)])
    helper = repo.path / "gatepkg" / "toy" / "_helper.py"
    helper.write_text(HELPER.replace("1024", "2048"))
    second = repo.commit("toy helper")
    e = _entries(df, base=first)
    assert e[("toy", "h100")].touched and e[("toy", "h100")].required and e[("toy", "h100")].status == "stale"
    assert e[("toy2", "h100")].touched is False and not e[("toy2", "h100")].required
    assert _gate_cli(repo, "--base", first) == 1
    assert "[untouched] fresh" in capsys.readouterr().out
    # Measured at the first commit, the toy lane is stale; from the second commit on nothing is touched.
    e = _entries(df, base=second)
    assert e[("toy", "h100")].status == "stale" and not e[("toy", "h100")].failing
    assert _gate_cli(repo, "--base", second) == 0
    # A docstring-only commit touches nothing.
    lane = repo.path / "gatepkg" / "toy2" / "gemm.py"
    lane.write_text(lane.read_text().replace("A toy lane", "A lane"))
    third = repo.commit("prose")
    assert not _entries(df, base=second)[("toy2", "h100")].touched
    assert third


def test_gate_bad_input_is_one_line(repo, lab_env, capsys):
    from lab.cli import main
    assert main(["gate", "--base", "no-such-ref", "--results", str(repo.results)]) == 2
    assert main(["gate", "--device", "h300", "--results", str(repo.results)]) == 2
    (lab_env.sweeps / "gate.toml").write_text("[required]\ngemm = 3\n")
    assert main(["gate", "--results", str(repo.results)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert "unknown git ref" in err[0] and "h300" in err[1] and "gate file" in err[2]


def test_export_and_best_round_trip(repo, capsys):
    rows = [_row("toy", commit=repo.head, ms=2.0, config={"BLOCK": 64}),
            _row("toy", commit=repo.head, ms=1.5, config={"BLOCK": 128}),
            _row("toy", commit=repo.head, ms=1.7, config={"BLOCK": 32}, phase="confirm"),
            _row("toy", commit=repo.head, ms=1.9, config={"BLOCK": 64}, phase="confirm"),
            _row("toy", commit=repo.head, ms=0.5, config={"BLOCK": 16}, status="wrong_result"),
            _row("toy2", commit=repo.head, ms=3.0, shape="sq8192_bf16")]
    _write(repo, rows)
    from lab.cli import main
    out = repo.path / "tuned"
    assert main(["export", "--results", str(repo.results), "--out", str(out)]) == 0
    doc = json.loads((out / "h100.json").read_text())
    assert doc["format"] == tuned.FORMAT and {e["dsl"] for e in doc["entries"]} == {"toy", "toy2"}
    t = tuned.best("gemm", "toy", "h100", "sq4096_bf16", path=out)
    # The fastest confirmed config wins over a faster unconfirmed sweep trial; failed trials never.
    assert t.config == {"BLOCK": 32} and t.exact and t.median_ms == 1.7 and t.fresh
    entry = next(e for e in doc["entries"] if e["dsl"] == "toy")
    assert entry["timing"] == "confirm" and entry["lane_files"]["gatepkg/toy/_helper.py"]
    assert tuned.best("gemm", "toy", "h100", {"M": 4096, "N": 4096, "K": 4096, "dtype": "bfloat16"}, path=out).exact
    with pytest.raises(LabError, match="no tuned gemm/toy2 on h100 at shape 'sq4096_bf16'.*nearest=True"):
        tuned.best("gemm", "toy2", "h100", "sq4096_bf16", path=out)
    near = tuned.best("gemm", "toy2", "h100", {"M": 4096, "N": 4096, "K": 4096, "dtype": "bfloat16"},
                      nearest=True, path=out)
    assert not near.exact and near.shape == "sq8192_bf16" and near.label.startswith("nearest to")
    with pytest.raises(LabError, match="non-numeric dims"):
        tuned.best("gemm", "toy2", "h100", {"M": 4096, "N": 4096, "K": 4096, "dtype": "float32"}, nearest=True,
                   path=out)
    with pytest.raises(LabError, match="no tuned configs for device 'gb10'"):
        tuned.best("gemm", "toy", "gb10", "sq4096_bf16", path=out)
    with pytest.raises(LabError, match="no tuned gemm/cute"):
        tuned.best("gemm", "cute", "h100", "sq4096_bf16", path=out)
    # A code change after the export marks the exported entry as not fresh on the next export.
    removed_knob = _row("toy", commit=repo.head, ms=0.9, config={"BLOCK": 64, "REMOVED": 1}, phase="confirm")
    (repo.path / "gatepkg" / "toy" / "_helper.py").write_text(textwrap.dedent(HELPER).replace("1024", "512"))
    tuned.export(results.load(repo.results), out, ["h100"])
    assert not tuned.best("gemm", "toy", "h100", "sq4096_bf16", path=out).fresh
    # With no fresh row, a faster row of a knob the lane no longer has (a config today's code cannot
    # run) does not outrank the runnable ones.
    _write(repo, [removed_knob])   # measured with the code before the change
    tuned.export(results.load(repo.results), out, ["h100"])
    t = tuned.best("gemm", "toy", "h100", "sq4096_bf16", path=out)
    assert t.config == {"BLOCK": 32} and not t.fresh
    # A sweep at the changed code outranks the confirm of the old code, though slower than that confirm.
    _write(repo, [_row("toy", commit=repo.commit(), ms=1.8, config={"BLOCK": 256})])
    tuned.export(results.load(repo.results), out, ["h100"])
    t = tuned.best("gemm", "toy", "h100", "sq4096_bf16", path=out)
    assert t.config == {"BLOCK": 256} and t.median_ms == 1.8 and t.fresh


def test_export_confirm_superseded_by_a_clearly_faster_sweep_config(repo):
    """The export takes a sweep trial over the fastest confirm when it is more than lab.headline.SUPERSEDE
    faster than the confirmed config's own sweep trial (a config found after the confirm)."""
    rows = [_row("toy", commit=repo.head, ms=1.75, config={"BLOCK": 32}),
            _row("toy", commit=repo.head, ms=1.7, config={"BLOCK": 32}, phase="confirm"),
            _row("toy", commit=repo.head, ms=1.0, config={"BLOCK": 8})]
    _write(repo, rows)
    out = repo.path / "tuned"
    tuned.export(results.load(repo.results), out, ["h100"])
    t = tuned.best("gemm", "toy", "h100", "sq4096_bf16", path=out)
    assert t.config == {"BLOCK": 8} and t.median_ms == 1.0
    assert json.loads((out / "h100.json").read_text())["entries"][0]["timing"] == "sweep"


def test_committed_export_matches_the_committed_results(tmp_path):
    """results/tuned/ is what `python -m lab export` writes from results/ (``fresh`` aside, which
    follows the checkout): rerun the export after committing new rows."""
    committed = identity.ROOT / "results" / "tuned"
    written = tuned.export(results.load(identity.ROOT / "results"), tmp_path)
    assert sorted(p.name for p in written) == sorted(p.name for p in committed.glob("*.json"))

    def strip(doc):
        for e in doc["entries"]:
            e.pop("fresh")
        return doc
    for p in written:
        assert strip(json.loads(p.read_text())) == strip(json.loads((committed / p.name).read_text())), p.name


# -- gate --run, with the simulated lane and a stand-in for the GPU worker ------------------------

SIM_BEST = {"MODE": "ok", "SMEM_KB": 16, "SPEED": 1, "ESTIMATE_BIAS_KB": 0}


class ABRunner:
    """Sweep trials as the sim lane's MODE says (tests.test_sweep_engine.SimRunner); A/B runs import
    every lane they are given (as the worker does) and return samples scaled by ``slowdown`` for the
    checkout's lane (dsl "sim", in whichever place the task lists it) and by ``first`` for the lane
    listed first (a bias of the place, not of the code)."""

    def __init__(self, slowdown: float, first: float = 1.0):
        from tests.test_sweep_engine import SimRunner
        self.sim, self.slowdown, self.first, self.ab_lanes = SimRunner(), slowdown, first, []

    def run(self, task, timeout_s):
        if task.get("kind") != "abab":
            return self.sim.run(task, timeout_s)
        self.ab_lanes.append([dsl for dsl, _, _ in task["lanes"]])
        for dsl, _, _ in task["lanes"]:
            assert registry.get(dsl, task["kernel"]).module.KERNEL == "gemm"
        base = [1.0 + 0.001 * (i % 7) for i in range(60)]
        scale = [(self.slowdown if dsl == "sim" else 1.0) * (self.first if i == 0 else 1.0)
                 for i, (dsl, _, _) in enumerate(task["lanes"])]
        return {"status": "ok", "stop": "test", "samples": [[x * k for x in base] for k in scale]}

    def close(self):
        pass


def _committed_sim_row(lab_env, config, lane_files):
    """A previous ok row of the sim lane at the checkout's commit, with the identity given; "tiny" is the
    one default shape (the gate holds a required lane to every default shape)."""
    _default_shapes(lab_env, ["tiny"])
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=identity.ROOT, capture_output=True, text=True).stdout.strip()
    row = _row("toy", commit=head, shape="tiny", config=config)
    row.update(dsl="sim", run_id="previous", versions_json=json.dumps(
        {"lab": lab.__version__, "lane_code": "x", "lane_files": lane_files, "lane_hash": identity.SCHEME}),
        shape_json=json.dumps({"M": 24, "N": 16, "K": 40, "dtype": "float32"}), dtype="float32")
    w = results.RunWriter(lab_env.results / "h100" / "gemm", "previous")
    w.add(row)
    return results.load(lab_env.results)


@pytest.mark.parametrize("slowdown,word,status", [(1.3, "SLOWER", 1), (1.0, "SAME", 0), (0.7, "FASTER", 0)])
def test_gate_run_ab_against_the_previous_code(lab_env, slowdown, word, status):
    from lab import gate_run
    from tests.test_sweep_engine import present_h100
    registry._LANES.clear()
    files = dict(identity.lane_identity("tests.fake_lanes.sim.gemm")["lane_files"])
    files["tests/fake_lanes/sim/gemm.py"] = "edited-since"  # the row ran other code: stale, A/B needs a copy
    df = _committed_sim_row(lab_env, SIM_BEST, files)
    lines, runner = [], ABRunner(slowdown)
    rc = gate_run.refresh(df, present_h100(), kernels=["gemm"], dsls=["sim"], trials=3, results_dir=lab_env.results,
                          runner=runner, out=lines.append)
    text = "\n".join(lines)
    assert rc == status, text
    assert f": {word}" in text and "gemm sim h100 tiny: previous" in text
    prev_dsl = runner.ab_lanes[0][0]
    assert prev_dsl.startswith("sim_at_") and runner.ab_lanes[0][1] == "sim"
    after = results.load(lab_env.results)
    gate_rows = after[after["phase"].isin(["gate_previous", "gate_checkout"])]
    assert sorted(gate_rows["phase"]) == ["gate_checkout", "gate_previous"] and (gate_rows["dsl"] == "sim").all()
    # The refreshed entry is fresh now (the previous code's A/B row does not count as a measurement),
    # unless the A/B judged today's code SLOWER: then the gate keeps failing on it.
    entries = gate.evaluate(after, devices=["h100"], kernels=["gemm"], dsls=["sim"])
    assert {e.status for e in entries} == {"slower" if word == "SLOWER" else "fresh"}


def test_gate_run_ab_runs_both_orders_so_a_place_bias_judges_nothing(lab_env):
    """Identical code, but the lane listed first in an A/B task times 2% faster (its place: built, allocated
    and warmed up first): with the previous lane always first this read as SLOWER; the A/B runs once in
    each order and pools each lane's samples, and the verdict is SAME."""
    from lab import gate_run
    from tests.test_sweep_engine import present_h100
    registry._LANES.clear()
    files = dict(identity.lane_identity("tests.fake_lanes.sim.gemm")["lane_files"])
    files["tests/fake_lanes/sim/gemm.py"] = "edited-since"
    df = _committed_sim_row(lab_env, SIM_BEST, files)
    lines, runner = [], ABRunner(1.0, first=0.98)
    rc = gate_run.refresh(df, present_h100(), kernels=["gemm"], dsls=["sim"], trials=0, results_dir=lab_env.results,
                          runner=runner, out=lines.append)
    text = "\n".join(lines)
    assert rc == 0 and ": SAME" in text, text
    prev_dsl = runner.ab_lanes[0][0]
    assert runner.ab_lanes == [[prev_dsl, "sim"], ["sim", prev_dsl]]
    rows = results.load(lab_env.results)
    gate_rows = rows[rows["phase"].isin(["gate_previous", "gate_checkout"])]
    assert (gate_rows["samples"] == 120).all()      # both halves' samples, each side


def test_a_slower_verdict_fails_the_gate_until_an_ab_at_the_same_code_clears_it(lab_env):
    """gate --run found today's code SLOWER: the static gate lists the entry as slower (required, failing)
    with the re-check command; the re-check times the same previous code again, not today's rows, and a
    SAME verdict makes the entry fresh."""
    from lab import gate_run
    from tests.test_sweep_engine import present_h100
    registry._LANES.clear()
    files = dict(identity.lane_identity("tests.fake_lanes.sim.gemm")["lane_files"])
    files["tests/fake_lanes/sim/gemm.py"] = "edited-since"
    df = _committed_sim_row(lab_env, SIM_BEST, files)
    assert gate_run.refresh(df, present_h100(), kernels=["gemm"], dsls=["sim"], trials=1,
                            results_dir=lab_env.results, runner=ABRunner(1.3), out=lambda _: None) == 1
    after = results.load(lab_env.results)
    (e,) = gate.evaluate(after, devices=["h100"], kernels=["gemm"], dsls=["sim"], required={"gemm": ["h100"]})
    assert e.status == "slower" and e.failing and e.stale_shapes == ["tiny"], e
    assert "SLOWER than the previous best's at tiny" in e.line()
    assert e.command() == "python -m lab gate --run --device h100 --kernel gemm --dsl sim --shape tiny"
    lines, runner = [], ABRunner(1.0)
    assert gate_run.refresh(after, present_h100(), kernels=["gemm"], dsls=["sim"], trials=0,
                            results_dir=lab_env.results, runner=runner, out=lines.append) == 0, lines
    assert runner.ab_lanes[0][0].startswith("sim_at_"), runner.ab_lanes   # the old code, not today's rows
    again = gate.evaluate(results.load(lab_env.results), devices=["h100"], kernels=["gemm"], dsls=["sim"])
    assert {x.status for x in again} == {"fresh"}


def test_gate_run_reports_a_previous_best_that_now_computes_garbage(lab_env):
    from lab import gate_run
    from tests.test_sweep_engine import present_h100
    registry._LANES.clear()
    wrong = {**SIM_BEST, "MODE": "wrong"}
    df = _committed_sim_row(lab_env, wrong, {"tests/fake_lanes/sim/gemm.py": "old"})
    lines = []
    rc = gate_run.refresh(df, present_h100(), kernels=["gemm"], dsls=["sim"], trials=3, results_dir=lab_env.results,
                          runner=ABRunner(1.0), out=lines.append)
    text = "\n".join(lines)
    assert rc == 1 and "PARITY FAIL gemm sim h100 tiny (the previous best)" in text, text


def test_gate_run_previous_best_is_the_fastest_row_of_any_phase():
    from lab import gate_run
    rows = pd.DataFrame([_row("toy", ms=2.0, phase="confirm", config={"BLOCK": 64}, time_utc="2026-11-22T10:00:00Z"),
                         _row("toy", ms=1.0, phase="sweep", config={"BLOCK": 32}, time_utc="2026-11-23T10:00:00Z")])
    best = gate_run._previous_best(rows)
    assert json.loads(best["sq4096_bf16"]["config_json"]) == {"BLOCK": 32}


def test_gate_run_shape_rechecks_a_fresh_entry(lab_env):
    from lab import gate_run
    from tests.test_sweep_engine import present_h100
    registry._LANES.clear()
    files = dict(identity.lane_identity("tests.fake_lanes.sim.gemm")["lane_files"])
    df = _committed_sim_row(lab_env, SIM_BEST, files)
    assert {e.status for e in gate.evaluate(df, devices=["h100"], kernels=["gemm"], dsls=["sim"])} == {"fresh"}
    lines, runner = [], ABRunner(1.0)
    assert gate_run.refresh(df, present_h100(), kernels=["gemm"], dsls=["sim"], trials=1,
                            results_dir=lab_env.results, runner=runner, out=lines.append) == 0
    assert lines == ["gate --run: nothing stale or unjudged to refresh on h100"] and not runner.ab_lanes
    rc = gate_run.refresh(df, present_h100(), kernels=["gemm"], dsls=["sim"], shapes=["tiny"], trials=1,
                          results_dir=lab_env.results, runner=runner, out=lines.append)
    text = "\n".join(lines)
    assert rc == 0 and "gemm sim h100 tiny: previous" in text and ": SAME" in text, text
    assert runner.ab_lanes == [["sim", "sim"]] * 2  # unchanged code: the checkout's lane on both sides, both orders
    with pytest.raises(LabError, match="unknown shape 'nope'"):
        gate_run.refresh(df, present_h100(), kernels=["gemm"], dsls=["sim"], shapes=["nope"], runner=runner)


def _two_shape_sim_rows(lab_env):
    """Previous ok rows of the sim lane at two default shapes (tiny, tiny_fp16), of other code than the
    checkout's: both shapes are stale."""
    registry._LANES.clear()
    df = _committed_sim_row(lab_env, SIM_BEST, {"tests/fake_lanes/sim/gemm.py": "old"})
    _default_shapes(lab_env, ["tiny", "tiny_fp16"])
    second = {**df.iloc[0].to_dict(), "run_id": "previous-fp16", "shape": "tiny_fp16", "dtype": "float16",
              "shape_json": json.dumps({"M": 33, "N": 24, "K": 40, "dtype": "float16"})}
    results.RunWriter(lab_env.results / "h100" / "gemm", "previous-fp16").add(second)
    return results.load(lab_env.results)


def test_gate_run_judges_each_shape_before_sweeping_the_next(lab_env):
    """A gate --run stopped part way (a device call's time limit) keeps the A/B verdicts of the shapes it
    finished: each shape is re-swept and judged before the next. It once re-swept every shape first and
    judged them after, so a run stopped in its third shape kept no verdict at all (H100, 2026-11-28, run
    20261128T002922Z-mamba_bwd_bwd-h100-781)."""
    from lab import gate_run
    from tests.test_sweep_engine import present_h100
    df = _two_shape_sim_rows(lab_env)

    class StopsAtTheSecondShape(ABRunner):
        def run(self, task, timeout_s):
            if task.get("kind") != "abab" and task["shape"]["dtype"] == "float16":
                raise KeyboardInterrupt
            return super().run(task, timeout_s)

    lines = []
    with pytest.raises(KeyboardInterrupt):
        gate_run.refresh(df, present_h100(), kernels=["gemm"], dsls=["sim"], trials=0,
                         results_dir=lab_env.results, runner=StopsAtTheSecondShape(1.0), out=lines.append)
    assert any(line.startswith("gemm sim h100 tiny: previous") for line in lines), lines
    after = results.load(lab_env.results)
    judged = after[after["phase"].isin(["gate_previous", "gate_checkout"])]
    assert set(judged["shape"]) == {"tiny"} and len(judged) == 2


def test_a_gate_run_stopped_before_a_shapes_ab_judges_that_shape_next_time(lab_env):
    """Stopped after a shape's re-sweep wrote its rows but before its A/B, the shape is fresh with no
    verdict (unjudged): the next plain gate --run judges it, and only it. It once answered "nothing
    stale to refresh", so the cuTile training shape kept no A/B (2 x H200, 2026-11-28,
    results/logs/20261128T151733Z-call-log.txt)."""
    from lab import gate_run
    from tests.test_sweep_engine import present_h100
    df = _two_shape_sim_rows(lab_env)

    class StopsAtTheSecondAB(ABRunner):
        def run(self, task, timeout_s):
            if task.get("kind") == "abab" and task["shape"]["dtype"] == "float16":
                raise KeyboardInterrupt
            return super().run(task, timeout_s)

    with pytest.raises(KeyboardInterrupt):
        gate_run.refresh(df, present_h100(), kernels=["gemm"], dsls=["sim"], trials=0,
                         results_dir=lab_env.results, runner=StopsAtTheSecondAB(1.0), out=lambda line: None)
    stopped = results.load(lab_env.results)
    (e,) = gate.evaluate(stopped, devices=["h100"], kernels=["gemm"], dsls=["sim"])
    assert e.status == "fresh" and e.unjudged == ["tiny_fp16"]
    lines, runner = [], ABRunner(1.0)
    assert gate_run.refresh(stopped, present_h100(), kernels=["gemm"], dsls=["sim"], trials=0,
                            results_dir=lab_env.results, runner=runner, out=lines.append) == 0
    text = "\n".join(lines)
    assert "sim h100: fresh, no A/B of this code; re-sweeping tiny_fp16" in text, text
    assert "gemm sim h100 tiny_fp16: previous" in text and "h100 tiny: previous" not in text, text
    (e,) = gate.evaluate(results.load(lab_env.results), devices=["h100"], kernels=["gemm"], dsls=["sim"])
    assert e.status == "fresh" and e.unjudged == []


@pytest.mark.parametrize("trials", [0, 2])
def test_gate_run_trials_are_new_configs_after_the_previous_best(lab_env, trials):
    """--trials N re-measures the previous best, then N new configs (0: the previous best alone; it once
    measured nothing at all, the seed counting as one of the N)."""
    from lab import gate_run
    from tests.test_sweep_engine import present_h100
    registry._LANES.clear()
    df = _committed_sim_row(lab_env, SIM_BEST, {"tests/fake_lanes/sim/gemm.py": "old"})
    lines = []
    assert gate_run.refresh(df, present_h100(), kernels=["gemm"], dsls=["sim"], trials=trials,
                            results_dir=lab_env.results, runner=ABRunner(1.0), out=lines.append) == 0, lines
    after = results.load(lab_env.results)
    new = after[(after["phase"] == "sweep") & (after["run_id"] != "previous") & (after["status"] != "infeasible")]
    assert len(new) == trials + 1 and json.loads(new.sort_values("trial")["config_json"].iloc[0]) == \
        registry.get("sim", "gemm").full_config(SIM_BEST)


def test_a_previous_best_at_a_value_the_file_no_longer_lists_still_gets_todays_code_timed(lab_env):
    """The previous best's config names a value today's sweep file does not list (the CuTe DSL GEMM's PATH
    "auto" at three H100 shapes): the re-sweep cannot measure it, so with --trials 0 it measured nothing
    and the gate failed on "no ok config" (run 20261127T225445Z-gemm-h100-886). Now the fastest committed
    config the file lists is measured too, and the A/B still times the previous best with its own code."""
    from lab import gate_run
    from tests.test_sweep_engine import present_h100
    registry._LANES.clear()
    df = _committed_sim_row(lab_env, {**SIM_BEST, "SMEM_KB": 32}, {"tests/fake_lanes/sim/gemm.py": "old"})
    listed = {**df.iloc[0].to_dict(), "run_id": "listed", "time_ms": df.iloc[0]["time_ms"] * 2,
              "config_json": json.dumps(registry.get("sim", "gemm").full_config(SIM_BEST))}
    w = results.RunWriter(lab_env.results / "h100" / "gemm", "listed")
    w.add(listed)
    df = results.load(lab_env.results)
    lines, runner = [], ABRunner(1.0)
    assert gate_run.refresh(df, present_h100(), kernels=["gemm"], dsls=["sim"], trials=0,
                            results_dir=lab_env.results, runner=runner, out=lines.append) == 0, lines
    text = "\n".join(lines)
    assert "seed not in" in text and "SMEM_KB=32" in text and "no ok config" not in text, text
    after = results.load(lab_env.results)
    new = after[(after["phase"] == "sweep") & ~after["run_id"].isin(["previous", "listed"])]
    assert [json.loads(c) for c in new["config_json"]] == [registry.get("sim", "gemm").full_config(SIM_BEST)]
    assert "gemm sim h100 tiny: previous" in text and ": SAME" in text
    ab = after[after["phase"] == "gate_previous"]
    assert json.loads(ab["config_json"].iloc[0])["SMEM_KB"] == 32       # the bar: the previous best itself


def test_gate_run_measures_the_sweep_files_seeds_after_the_previous_best(lab_env):
    """A branch that adds a seed to the sweep file gets it measured by `gate --run --trials 1`: the new
    study takes the request's seed (the previous best) and then the file's (before, the previous best
    made the study look resumed and the file's seeds were never enqueued: an UNROLL seed of the CuTe
    bwd_bwd went unmeasured by such a gate, run 20261126T104424Z-mamba_bwd_bwd-h100-1611)."""
    from lab import gate_run
    from tests.test_sweep_engine import present_h100
    seed = {"MODE": "ok", "SMEM_KB": 64, "SPEED": 2, "ESTIMATE_BIAS_KB": 0}
    with open(lab_env.sweeps / "gemm" / "sim.toml", "a") as f:
        f.write("\n[[seed]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in seed.items()))
    registry._LANES.clear()
    df = _committed_sim_row(lab_env, SIM_BEST, {"tests/fake_lanes/sim/gemm.py": "old"})
    lines = []
    assert gate_run.refresh(df, present_h100(), kernels=["gemm"], dsls=["sim"], trials=1,
                            results_dir=lab_env.results, runner=ABRunner(1.0), out=lines.append) == 0, lines
    after = results.load(lab_env.results)
    new = after[(after["phase"] == "sweep") & (after["run_id"] != "previous")].sort_values("trial")
    sim = registry.get("sim", "gemm")
    assert [json.loads(c) for c in new["config_json"]] == [sim.full_config(SIM_BEST), sim.full_config(seed)], lines


def test_gate_run_times_todays_fastest_row_not_only_this_runs(lab_env):
    """The A/B's checkout side is today's code at its fastest config, committed rows included: a re-check
    whose --trials measured only a slower seed once timed that seed against the previous best (cuTile
    m2rnn_bwd at b4_n44, run 20261126T134510Z-m2rnn_bwd-h100-2919: 7.74 ms while the same code's committed
    best there was 5.87 ms)."""
    from lab import gate_run
    from tests.test_sweep_engine import present_h100
    registry._LANES.clear()
    df = _committed_sim_row(lab_env, SIM_BEST, {"tests/fake_lanes/sim/gemm.py": "old"})
    fast = {**SIM_BEST, "SMEM_KB": 32}
    today = df.iloc[0].to_dict()
    today.update(run_id="today", config_json=json.dumps(registry.get("sim", "gemm").full_config(fast)), time_ms=1e-6,
                 versions_json=json.dumps({**json.loads(today["versions_json"]),
                                           **identity.lane_identity("tests.fake_lanes.sim.gemm")}))
    # ... and a later A/B that judged today's code SLOWER at the previous best's config: a re-check.
    slower = {**today, "config_json": df.iloc[0]["config_json"], "time_ms": 2.0, "phase": "gate_checkout",
              "study": "gate SLOWER", "time_utc": "2026-11-25T10:00:00Z"}
    w = results.RunWriter(lab_env.results / "h100" / "gemm", "today")
    w.add(today)
    w.add(slower)
    df = results.load(lab_env.results)
    assert [e.status for e in gate.evaluate(df, devices=["h100"], kernels=["gemm"], dsls=["sim"])] == ["slower"]
    runner = ABRunner(1.0)
    seen = []
    run = runner.run
    runner.run = lambda task, t: (seen.append({d: c for d, c, _ in task["lanes"]}["sim"]) if task.get("kind") == "abab"
                                  else None) or run(task, t)
    lines = []
    assert gate_run.refresh(df, present_h100(), kernels=["gemm"], dsls=["sim"], shapes=["tiny"], trials=0,
                            results_dir=lab_env.results, runner=runner, out=lines.append) == 0, lines
    assert seen == [registry.get("sim", "gemm").full_config(fast)] * 2, lines    # the A/B in both orders


def test_a_previous_best_at_a_retired_precision_knob_is_not_the_bar():
    """A row from before a precision knob left the search space (the Triton M2RNN forward at DOT =
    tf32x3 on fp32 inputs; the default is the inputs' own precision) is not a default-precision row:
    export and the gate's previous best skip it, and a SLOWER verdict against it (run
    20261126T221319Z-m2rnn_fwd-h100-3591: 1.126x, tf32x3 against fp32 products) judges no code change."""
    import pandas as pd
    module = registry.get("triton", "m2rnn_fwd").module_name
    current = identity.lane_identity(module)
    rows = []
    for phase, cfg in (("gate_previous", {"DOT": "tf32x3", "FAST_TANH": False}), ("gate_checkout", {})):
        row = {c: None for c in results.COLUMNS}
        row.update(run_id="ab-run", time_utc="2026-11-26T22:13:19Z", git_commit="", git_dirty=False,
                   kernel="m2rnn_fwd", dsl="triton", shape="fp32_k64_v64", config_json=json.dumps({"K_SPLIT": 2, **cfg}),
                   phase=phase, requested_profile="h100", emulated=False, compile_only=False, status="ok", time_ms=4.9,
                   study="gate SLOWER", versions_json=json.dumps({"lab": lab.__version__, **current}))
        rows.append(row)
    df = pd.DataFrame(rows)
    previous, checkout = df.iloc[0], df.iloc[1]
    assert not gate.at_default_precision(previous) and gate.at_default_precision(checkout)
    mine = df[df["phase"] == "gate_checkout"]
    pins = gate.pinned_toolchain()
    assert gate.slower_verdicts(mine, module, current, pins) == {"fp32_k64_v64": "ab-run"}
    assert gate.slower_verdicts(mine, module, current, pins, frozenset({("ab-run", "fp32_k64_v64")})) == {}
    assert len(gate.ok_rows(df.assign(phase="sweep"))) == 1      # the tf32x3 row is not a default-precision row


def test_an_emulated_row_of_a_path_the_profile_cannot_run_is_no_bar(lab_env, monkeypatch):
    """An emulated row whose config today's lane refuses for the profile's target timed a path that
    device cannot run (the CuTe DSL GEMM's PATH "auto" ran wgmma under the GB10 profile on an H100, runs
    20261127T155404Z-gemm-gb10-emulated-3723 and after): the gate does not A/B against it, says why, and
    export skips it; a native row of the same config stays the bar on its own device."""
    from lab import gate_run
    from tests.test_sweep_engine import present_h100
    registry._LANES.clear()
    df = _committed_sim_row(lab_env, SIM_BEST, {"tests/fake_lanes/sim/gemm.py": "old"})
    emulated = {**df.iloc[0].to_dict(), "run_id": "emulated", "requested_profile": "gb10", "emulated": True}
    w = results.RunWriter(lab_env.results / "gb10" / "gemm", "emulated")
    w.add(emulated)
    df = results.load(lab_env.results)
    lane = registry.get("sim", "gemm")
    monkeypatch.setattr(lane.module, "target_reason",
                        lambda c, t: "SPEED 1 is an sm_90a path" if t != "sm_90a" and c["SPEED"] == 1 else None)
    misfits = gate.emulated_misfits(df, lane, "sm_121a")
    assert list(df.loc[list(misfits), "run_id"]) == ["emulated"] and set(misfits.values()) == {"SPEED 1 is an sm_90a path"}
    assert gate.emulated_misfits(df, lane, "sm_90a") == {}
    retired = df.assign(config_json=json.dumps({**SIM_BEST, "SPEED": 2, "GONE": 1}))   # a knob removed since
    assert gate.emulated_misfits(retired, lane, "sm_121a") == {}
    lines = []
    assert gate_run.refresh(df, present_h100(), devices=["gb10"], kernels=["gemm"], dsls=["sim"], trials=1,
                            results_dir=lab_env.results, runner=ABRunner(1.0), out=lines.append) == 0, lines
    text = "\n".join(lines)
    assert "gemm sim gb10 tiny: 1 emulated row(s) no bar, the lane refuses their config for sm_121a: SPEED 1" in text
    assert "gemm sim gb10 tiny: NEW (new best" in text and "no previous ok row" in text and "A/B" not in text, text
    # Export: the refused emulated row is not gb10's tuned config where another row qualifies.
    after = results.load(lab_env.results)
    [entry] = [e for e in tuned.entries(after, "gb10") if e["dsl"] == "sim"]
    assert entry["config"]["SPEED"] == 2 and entry["emulated"], entry
