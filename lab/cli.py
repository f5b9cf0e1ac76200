"""Command line: python -m lab {devices,list,preflight,sweep,check,profile,gate,export,merge,prune,report}.

Bad input (unknown kernel, device, DSL, shape or config key; malformed sweep file) prints one line
``error: ...`` on stderr and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from lab.devices import LabError, PROFILES, detect, get_profile, present_label


def cmd_devices(args) -> int:
    present = detect()
    print(f"present GPU: {present_label(present)}" + (f" -> profile {present.profile}" if present and present.profile else ""))
    print(f"{'':2}{'profile':8} {'GPU':18} {'target':8} {'SMs':>4} {'SMEM/block (opt-in)':>20} {'L2':>8} "
          f"{'mem GB/s':>9} {'bf16 TFLOP/s':>12}")
    for p in PROFILES.values():
        mark = "* " if present and present.profile == p.name else "  "
        l2 = f"{p.l2_bytes // (1 << 20)} MiB" if p.l2_bytes else "-"
        print(f"{mark}{p.name:8} {p.gpu:18} {p.target:8} {p.sms:>4} {p.smem_optin_bytes:>11,} B ({p.smem_optin_kib:.0f} KiB)"
              f" {l2:>8} {p.mem_bw_gbs or '-':>9} {p.bf16_tflops or '-':>12}")
    print("(* = present; sources: python -c 'from lab.devices import PROFILES; print(PROFILES[\"h100\"].sources)')")
    return 0


def cmd_list(args) -> int:
    from lab import problems, registry
    prof = get_profile(args.device)
    kernels = [args.kernel] if args.kernel else problems.names()
    for k in kernels:
        problems.get(k)
    print(f"eligibility on {prof.name} ({prof.target}):")
    for k in kernels:
        for dsl, e in registry.eligibility_table(k, prof.target).items():
            print(f"  {k:16} {dsl:10} {e}")
    return 0


def cmd_preflight(args) -> int:
    from lab import preflight, problems, registry, space
    prof = get_profile(args.device)
    problem = problems.get(args.kernel)
    shapes, default = space.load_shapes(args.kernel)
    names = args.shape.split(",") if args.shape else list(shapes)
    for n in names:
        if n not in shapes:
            raise LabError(f"unknown shape {n!r} for {args.kernel} (known: {', '.join(shapes)})")
    table = registry.eligibility_table(args.kernel, prof.target)
    if args.dsl != "all":
        registry.get(args.dsl, args.kernel)  # unknown DSL / no file for this kernel: one-line error
    dsls = list(table) if args.dsl == "all" else [args.dsl]
    limit = None if args.compile_limit < 0 else args.compile_limit
    for n in names:
        shape = dict(shapes[n])
        problem.check_shape(shape)
        print(f"preflight {args.kernel} shape {n} {json.dumps(shape)} on {prof.name} ({prof.target}, "
              f"limit {prof.smem_optin_bytes:,} B)")
        for dsl in dsls:
            e = table[dsl]
            if not e.ok:
                print(f"  {dsl:8} {e}")
                continue
            lane = registry.get(dsl, args.kernel)
            sp = space.load_space(args.kernel, dsl, tuple(lane.module.TUNABLES))
            s = preflight.summarize(lane, sp, shape, prof, limit, seed=args.seed, workers=args.jobs)
            rules = sum(v for k, v in s["rejected"].items() if k != "estimate")
            of = f" (a seeded sample of its {s['space_size']:,})" if s["space_sampled"] else ""
            print(f"  {dsl:8} {s['space']} configs{of}: {rules} break rules, {s['over_estimate']} over the limit by "
                  f"estimate, {s['fit_estimate']} fit by estimate")
            if s["unsupported"]:
                print(f"  {'':8} no compile-verified figure: {s['unsupported']}")
                continue
            print(f"  {'':8} compiled {s['sampled']} for {prof.target} (seeded sample of the fitting and over-estimate "
                  f"configs; --compile-limit -1 for all): {s['fit_compiled']} fit, {s['compile_errors']} compile errors; "
                  f"estimate == compiler for {s['agree_exact']}/{s['compiled']}; "
                  f"{len(s['wrong_side_of_limit'])} on the wrong side of the limit")
            for r in s["disagree"][: args.show]:
                print(f"  {'':8}   estimate {r['estimate']:>7} B vs compiled {r['compiled']:>7} B  {json.dumps(r['config'])}")
            if not args.brief:
                for r in sorted(s["rows"], key=lambda r: (r["compiled"] is None, r["compiled"] or 0)):
                    if r["compiled"] is None:
                        verdict, fig = "error", (r["error"] or "")[:120]
                    else:
                        verdict = "fits" if r["compiled"] <= s["limit"] else "over"
                        fig = f"{r['compiled']:>7,} B compiled, {r['estimate'] or 0:>7,} B estimated, {r['registers']} regs"
                    print(f"  {'':8}   {verdict:5} {fig}  {json.dumps(r['config'], sort_keys=True)}")
    return 0


def cmd_sweep(args) -> int:
    """Validates every name (kernel, DSLs, device, shapes) before looking at the GPU."""
    from lab import problems, registry, space, sweep
    problems.get(args.kernel)
    dsls = None if args.dsl == "all" else [d.strip() for d in args.dsl.split(",")]
    for d in dsls or []:
        registry.get(d, args.kernel)
    get_profile(args.device)
    shapes, _ = space.load_shapes(args.kernel)
    for n in args.shape or []:
        if n not in shapes:
            raise LabError(f"unknown shape {n!r} for {args.kernel} (known: {', '.join(shapes)})")
    if args.precision:
        tuned = [lane for lane in (registry.lanes_for(args.kernel) if dsls is None else
                                   [registry.get(d, args.kernel) for d in dsls]) if not sweep._safe_baseline(lane)]
        lacking = [lane.dsl for lane in tuned if args.precision not in space.precisions(args.kernel, lane.dsl)]
        if lacking:
            raise LabError(f"--precision {args.precision}: no [precision.{args.precision}] in the sweep file of "
                           f"{', '.join(lacking)} ({args.kernel}); name the DSLs that declare it with --dsl")
    if args.gpus:
        from lab import multi
        import torch
        gpus = multi.gpu_list(args.gpus, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        if len(gpus) > 1:
            return multi.run_workers(args.argv, gpus, args.compile_workers)
        os.environ["CUDA_VISIBLE_DEVICES"], os.environ["LAB_GPU_INDEX"] = str(gpus[0]), str(gpus[0])
    if args.seed_from:
        if not args.seed_best:
            raise LabError("--seed-from needs --seed-best")
        get_profile(args.seed_from)
    present = detect()
    seeds = {}
    if args.seed_best:
        from lab import report, results
        rows = results.load(args.results)
        best = report.headline_configs(rows, args.kernel, args.device, args.emulate)
        if args.emulate and present is not None:   # the best timed on this GPU where it has one, else another's
            best |= report.headline_configs(rows, args.kernel, args.device, True, present.name)
        if args.seed_from:
            best = report.headline_configs(rows, args.kernel, args.seed_from, False) | best
        seeds = {k: [cfg] for k, cfg in best.items()}
    req = sweep.SweepRequest(
        kernel=args.kernel, device=args.device, dsls=dsls, shapes=args.shape or None, trials=args.trials,
        timeout_s=args.timeout, sampler=args.sampler, seed=args.seed, storage=args.storage, emulate=args.emulate,
        compile_only=args.compile_only, results_dir=Path(args.results), prefetch=args.prefetch,
        compile_workers=args.compile_workers,
        baseline=not args.no_baseline, confirm=not args.no_confirm, progress=not args.no_progress,
        precision=args.precision, seeds=seeds, new_trials=args.seed_best)
    sw, summary = sweep.run(req, present)
    print(f"results: {sw.writer.path} ({len(sw.writer.rows)} rows)")
    return 0


def cmd_dashboard(args) -> int:
    """optuna-dashboard on a study storage; the lab's trial attributes show under each trial."""
    url = args.storage
    if url is None:
        found = sorted(Path("results").rglob("optuna.db"))
        if not found:
            raise LabError("no optuna.db under results/: name a storage URL or file")
        url = str(found[0])
    if "://" not in url:
        if not Path(url).is_file():
            raise LabError(f"no such storage file {url}")
        url = f"sqlite:///{Path(url).resolve()}"
    try:
        import optuna_dashboard
    except ImportError:
        raise LabError("optuna-dashboard is not installed (pip install -e '.[dev]' pins it)") from None
    print(f"dashboard: http://127.0.0.1:{args.port}/ on {url}; trial attributes: status, error, parity_rel_l2, "
          f"smem_compiled_bytes, host, gpu_index (Ctrl-C stops)", flush=True)
    optuna_dashboard.run_server(url, host="127.0.0.1", port=args.port)
    return 0


def cmd_report(args) -> int:
    from lab import report
    out = report.write(Path(args.path), Path(args.out) if args.out else None)
    print(f"report: {out}")
    return 0


def cmd_gate(args) -> int:
    """Exit 1 when a required entry is stale or never measured; 0 when every one is fresh."""
    from lab import gate, results
    df = results.load(args.results)
    if args.run:
        from lab import gate_run
        return gate_run.refresh(df, detect(), devices=args.device, kernels=args.kernel, dsls=args.dsl,
                                shapes=args.shape, trials=args.trials, results_dir=Path(args.results), timeout_s=args.timeout)
    entries = gate.evaluate(df, devices=args.device, base=args.base, kernels=args.kernel, dsls=args.dsl)
    scope = f"lanes touched since {args.base}" if args.base else "every required entry"
    print(f"gate: {len(df)} rows under {args.results}; required: {scope} (sweeps/gate.toml)")
    for e in entries:
        print(e.line())
    failing = [e for e in entries if e.failing]
    counts = {s: sum(e.status == s for e in entries) for s in ("fresh", "stale", "slower", "never measured")}
    print(f"{counts['fresh']} fresh, {counts['stale']} stale, {counts['slower']} slower, "
          f"{counts['never measured']} never measured; "
          f"{len(failing)} required entr{'y needs' if len(failing) == 1 else 'ies need'} a sweep")
    return 1 if failing else 0


def _shape_names(values: list[str]) -> list[str]:
    return [s for v in values for s in v.split(",") if s]


def cmd_check(args) -> int:
    from lab import check
    return check.check(args.kernel, args.dsl, _shape_names(args.shape), args.config, args.device, args.traceback)


def cmd_profile(args) -> int:
    from lab import check
    return check.profile(args.kernel, args.dsl, _shape_names(args.shape), args.config, args.device, args.calls,
                         args.top)


def cmd_export(args) -> int:
    from lab import results, tuned
    for path in tuned.export(results.load(args.results), Path(args.out), args.device):
        print(f"tuned: {path}")
    return 0


def cmd_merge(args) -> int:
    from lab import merge
    out = merge.merge([Path(p) for p in args.paths], Path(args.results))
    for line in out.lines():
        print(line)
    print(f"merged {len(args.paths)} call(s) into {args.results}: {len(out.copied)} files copied, "
          f"{len(out.studies)} studies and {out.n_trials} trials "
          f"added, {len(out.conflicts)} conflicts")
    return 1 if out.conflicts else 0


def cmd_prune(args) -> int:
    from lab import prune, registry, results
    dsls = [l.dsl for l in registry.lanes_for(args.kernel)] if args.dsl == "all" else args.dsl.split(",")
    print(prune.report(results.load(args.results), args.kernel, dsls, args.within, args.min_rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab", description="GPU kernel lab: sweep, check and compare kernels across DSLs")
    sub = p.add_subparsers(dest="cmd", required=True)

    sub.add_parser("devices", help="list device profiles and mark the GPU present").set_defaults(fn=cmd_devices)

    s = sub.add_parser("list", help="kernels x DSLs and their eligibility on a device")
    s.add_argument("kernel", nargs="?")
    s.add_argument("--device", default="h100")
    s.set_defaults(fn=cmd_list)

    s = sub.add_parser("preflight", help="which configs fit a device, estimate vs compiler (no GPU needed)")
    s.add_argument("kernel")
    s.add_argument("--device", required=True)
    s.add_argument("--dsl", default="all")
    s.add_argument("--shape", help="named shape(s), comma-separated (default: every named shape of the kernel)")
    s.add_argument("--compile-limit", type=int, default=48,
                   help="compile at most N configs (a seeded sample; -1 = all)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--show", type=int, default=5, help="disagreements to print")
    s.add_argument("--brief", action="store_true",
                   help="counts only (default: also list every compiled config: fits / over, bytes, registers)")
    s.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="compile processes")
    s.set_defaults(fn=cmd_preflight)

    s = sub.add_parser("sweep", help="tune a kernel on a device (resumable Optuna study)")
    s.add_argument("kernel")
    s.add_argument("--device", required=True)
    s.add_argument("--dsl", default="all", help="a DSL, a comma list, or all")
    s.add_argument("--shape", action="append", help="named shape (repeatable; default: the kernel's default list)")
    s.add_argument("--trials", type=int, default=40, help="measured configs per DSL and shape (resume counts earlier ones)")
    s.add_argument("--timeout", type=float, default=300.0, help="seconds per candidate (compile + parity + timing)")
    s.add_argument("--sampler", default="tpe", choices=["tpe", "random", "grid"])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--storage", help="Optuna storage URL (default: sqlite file under results/<device>/<kernel>/)")
    mode = s.add_mutually_exclusive_group()
    mode.add_argument("--emulate", action="store_true", help="run the device's envelope on the GPU present (rows marked emulated)")
    mode.add_argument("--compile-only", action="store_true", help="preflight and compile for the target, run nothing")
    s.add_argument("--results", default="results")
    s.add_argument("--prefetch", type=int, default=2, help="candidates compiled ahead of the GPU (0 = none)")
    s.add_argument("--compile-workers", type=int, default=2, help="CPU processes for ahead-of-time compiles")
    s.add_argument("--no-baseline", action="store_true", help="do not add the baseline lane")
    s.add_argument("--no-confirm", action="store_true", help="skip the A/B re-timing of the best configs")
    s.add_argument("--seed-best", action="store_true",
                   help="measure each lane's best committed config (the report's headline row) first, where its "
                        "study lacks it; --trials then counts new configs after it (0: none), so that "
                        "--trials 0 --seed-best A/B-confirms every lane's best in one run")
    s.add_argument("--seed-from", metavar="PROFILE",
                   help="with --seed-best: where the requested device has no best of a lane at a shape, take "
                        "PROFILE's native best (a first sweep on a new GPU starts from another GPU's bests)")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--gpus", help="all, or a comma list of GPU indices: one worker per GPU on the same study")
    s.add_argument("--precision", help="fix the sweep files' [precision.NAME] table (e.g. exact: IEEE products, "
                   "exact tanh) in every trial; default: the lanes' defaults")
    s.set_defaults(fn=cmd_sweep)

    s = sub.add_parser("dashboard", help="optuna-dashboard on a study storage (trial status, error, parity, SMEM)")
    s.add_argument("storage", nargs="?", help="storage URL or a results/<device>/<kernel>/optuna.db file "
                   "(default: the first optuna.db under results/)")
    s.add_argument("--port", type=int, default=8080)
    s.set_defaults(fn=cmd_dashboard)

    for name, text in (("check", "one lane now: parity on every output and the harness's timing, per config and shape"),
                       ("profile", "one lane's GPU time per launched kernel (torch.profiler, L2 flushed per call)")):
        s = sub.add_parser(name, help=text)
        s.add_argument("kernel")
        s.add_argument("--dsl", required=True)
        s.add_argument("--shape", action="append", required=True, help="named shape(s), comma-separated or repeated")
        s.add_argument("--config", action="append", help="JSON object of tunables (defaults for the rest); repeatable")
        s.add_argument("--device", help="cuda (default when a GPU is present) or cpu")
        if name == "check":
            s.add_argument("--traceback", action="store_true", help="print the traceback of a failed config")
            s.set_defaults(fn=cmd_check)
        else:
            s.add_argument("--calls", type=int, default=10)
            s.add_argument("--top", type=int, default=8, help="kernels to list per shape")
            s.set_defaults(fn=cmd_profile)

    s = sub.add_parser("gate", help="which results no longer describe the checkout: what a merge must re-sweep (no GPU)")
    s.add_argument("--base", help="git ref: require only the lanes that base..checkout touched")
    s.add_argument("--device", nargs="+", help="device profiles to check (default: all with results or required)")
    s.add_argument("--kernel", nargs="+", help="only these kernels")
    s.add_argument("--dsl", nargs="+", help="only these DSLs")
    s.add_argument("--results", default="results")
    s.add_argument("--run", action="store_true", help="on a GPU: re-sweep the stale entries of this device (and of any "
                   "--device named, emulated) and A/B the new best against the previous best's code; exit 1 on "
                   "SLOWER or a wrong result")
    s.add_argument("--trials", type=int, default=8, help="with --run: new trials per stale shape after the previous best")
    s.add_argument("--shape", action="append", help="with --run: re-check these shapes of the selected entries, "
                   "fresh or not (repeatable)")
    s.add_argument("--timeout", type=float, default=300.0, help="with --run: seconds per candidate")
    s.set_defaults(fn=cmd_gate)

    s = sub.add_parser("export", help="write the best confirmed config per kernel, DSL and shape to results/tuned/<device>.json")
    s.add_argument("--device", nargs="+", help="device profiles (default: every one with ok rows)")
    s.add_argument("--results", default="results")
    s.add_argument("--out", default="results/tuned")
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser("merge", help="merge GPU calls' results (results.tgz, or their output folders) into results/")
    s.add_argument("paths", nargs="+", help="a call's results.tgz, or a folder holding it (and its log.txt)")
    s.add_argument("--results", default="results")
    s.set_defaults(fn=cmd_merge)

    s = sub.add_parser("prune", help="knob values of the sweep files that no committed result supports (no GPU)")
    s.add_argument("kernel")
    s.add_argument("--dsl", default="all", help="a DSL, a comma list, or all")
    s.add_argument("--within", type=float, default=0.05, help="a value is supported within this fraction of the lane's best")
    s.add_argument("--min-rows", type=int, default=3, help="ok rows a value needs before it is judged slower")
    s.add_argument("--results", default="results")
    s.set_defaults(fn=cmd_prune)

    s = sub.add_parser("report", help="markdown summary and PNG plots of result tables")
    s.add_argument("path", nargs="?", default="results")
    s.add_argument("--out", help="folder for report.md and plots (default: <path>/report)")
    s.set_defaults(fn=cmd_report)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # --gpus hands them to its workers
    try:
        return args.fn(args)
    except LabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted (finished trials are saved)", file=sys.stderr)
        return 130
