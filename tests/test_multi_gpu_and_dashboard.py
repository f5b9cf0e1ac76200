"""``sweep --gpus``: the GPU list, the workers' arguments, and two real worker processes sharing one
study (compile-only, so no GPU is needed); ``lab dashboard`` serving a study over HTTP."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from lab import multi
from lab.devices import LabError
from lab.results import load
from tests.conftest import load_script


def test_gpu_list_and_worker_arguments():
    assert multi.gpu_list("all", 4) == [0, 1, 2, 3] and multi.gpu_list("1,3", 4) == [1, 3]
    for spec, visible, needle in (("all", 0, "no GPU"), ("4", 4, "indices 0..3"), ("0,0", 2, "each named once"),
                                  ("x", 2, "comma list")):
        with pytest.raises(LabError, match=needle):
            multi.gpu_list(spec, visible)
    argv = ["sweep", "gemm", "--device", "h100", "--gpus", "all", "--compile-workers", "8", "--trials", "5"]
    assert multi.worker_argv(argv, 3) == ["sweep", "gemm", "--device", "h100", "--trials", "5",
                                          "--compile-workers", "3", "--no-progress"]


def test_two_workers_one_per_gpu_share_the_study(lab_env):
    (lab_env.sweeps / "gemm" / "sim.toml").write_text(
        '[params]\nMODE = ["ok", "slow"]\nSMEM_KB = [16, 32, 48, 64]\nSPEED = [1, 2, 3]\nESTIMATE_BIAS_KB = [0]\n')
    lines = []
    argv = ["sweep", "gemm", "--device", "h100", "--dsl", "sim", "--shape", "tiny", "--compile-only", "--trials", "10",
            "--sampler", "random", "--no-baseline", "--results", str(lab_env.results), "--gpus", "0,1"]
    assert multi.run_workers(argv, [0, 1], compile_workers=2, out=lines.append) == 0, "\n".join(lines)
    rows = load(lab_env.results)
    assert len(rows) == 10 and rows["config_json"].is_unique, "\n".join(lines)
    assert set(rows["gpu_index"].astype(int)) <= {0, 1} and rows["run_id"].nunique() == 2
    assert any(l.startswith("[gpu 0] ") for l in lines) and any(l.startswith("[gpu 1] ") for l in lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dashboard_serves_a_study(lab_env, tmp_path):
    import optuna
    db = tmp_path / "optuna.db"
    study = optuna.create_study(study_name="gemm|sim|tiny", storage=f"sqlite:///{db}")
    t = study.ask()
    t.set_user_attr("status", "ok")
    study.tell(t, 1.0)
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "lab", "dashboard", str(db), "--port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    try:
        deadline, body = time.time() + 60, None
        while time.time() < deadline and body is None:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=2).read()
            except OSError:
                time.sleep(0.5)
        assert body is not None, "the dashboard never answered"
        names = [s["study_name"] for s in json.loads(body)["study_summaries"]]
        assert names == ["gemm|sim|tiny"]
    finally:
        p.kill()
        p.wait()


def test_multi_gpu_study_reads_nvidia_smi_samples():
    mod = load_script("multi_gpu_study")
    text = "0, 100, 5000\n1, 0, 700\n0, 50, 5200\n1, 30, 900\n[N/A], 1, 2\n"
    u = mod.utilisation(text).set_index("gpu")
    assert list(u.index) == [0, 1] and u.loc[0, "mean_util"] == 75 and u.loc[1, "busy_share"] == 0.5
    assert u.loc[0, "peak_mem_mib"] == 5200 and u.loc[1, "samples"] == 2
    assert mod.utilisation("").empty


@pytest.mark.parametrize("env,measures,gpu", [({"LAB_GPU_INDEX": "3", "CUDA_VISIBLE_DEVICES": "3"}, True, 3),
                                              ({"CUDA_VISIBLE_DEVICES": "2,0"}, True, 2),
                                              ({}, True, 0), ({}, False, None),
                                              ({"CUDA_VISIBLE_DEVICES": "GPU-0b0c"}, True, None)])
def test_rows_name_the_gpu_that_measured_them(monkeypatch, env, measures, gpu):
    from lab.study import worker_identity
    for k in ("LAB_GPU_INDEX", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert worker_identity(measures)["gpu_index"] == gpu


def test_multi_gpu_study_report_from_committed_runs(tmp_path):
    """--from-runs: the comparison table of two runs already under results/, walls from their rows."""
    from lab.results import COLUMNS, RunWriter
    mod = load_script("multi_gpu_study")

    def row(run, gpu, t, ms, cfg):
        r = {c: None for c in COLUMNS}
        r.update(run_id=run, time_utc=t, kernel="gemm", dsl="triton", shape="s", config_json=json.dumps(cfg),
                 status="ok", phase="sweep", time_ms=ms, gpu_index=gpu, actual_gpu="NVIDIA H200",
                 requested_profile="h200", emulated=False, baseline=False)
        return r
    runs = {"20261126T000000Z-gemm-h200-1": [row("20261126T000000Z-gemm-h200-1", 0, "2026-11-26T00:01:00Z", 1.0, {"B": 1})],
            "20261126T000000Z-gemm-h200-2": [row("20261126T000000Z-gemm-h200-2", 1, "2026-11-26T00:01:40Z", 0.9, {"B": 2})],
            "20261126T000200Z-gemm-h200-3": [row("20261126T000200Z-gemm-h200-3", 0, "2026-11-26T00:03:00Z", 1.0, {"B": 1}),
                                             row("20261126T000200Z-gemm-h200-3", 0, "2026-11-26T00:05:20Z", 0.9, {"B": 2})]}
    for run, rows in runs.items():
        w = RunWriter(tmp_path / "h200" / "gemm", run)
        for r in rows:
            w.add(r)
    smi = tmp_path / "one.csv"
    smi.write_text("0, 90, 100\n1, 0, 4\n")
    ids = list(runs)
    assert mod.main(["--kernel", "gemm", "--results", str(tmp_path), "--from-runs", ",".join(ids[:2]), ids[2],
                     "--smi", "-", str(smi)]) == 0
    md = (tmp_path / "logs" / f"{ids[0]}-multi-gpu.md").read_text()
    assert "--gpus all: wall 100.0 s" in md and "per GPU index: {0: 1, 1: 1}" in md
    assert "--gpus 0: wall 200.0 s" in md and "wall time one GPU / all GPUs: 2.00x" in md
    assert "GPU 0: 1 samples, mean utilisation 90.0 %" in md
    assert "| triton | s | 2 / 2 | 0 | 0.9000 | 0.9000 | 1.0000 | same config |" in md
