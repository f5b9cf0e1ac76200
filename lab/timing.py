"""Timing one kernel call: L2 flushed before every sample, one event pair per call, adaptive stop.

All times are milliseconds. On a CUDA device each sample is bracketed by its own CUDA event pair
after a write of a buffer twice the device's L2 size (read from the device); on the CPU the host
clock is used (tests, and the torch lane on CPU). A GPU spin before each sample gives the host a
head start (twice the call's host time, measured in the warm-up), so launch overhead does not leak into
the events. Sampling stops when the 95% confidence interval
of the median (order statistics) is narrower than ``rel_ci`` of the median, or at the budget.
Calls under ~20 us are also timed as CUDA-graph replays, with the flush's own cost subtracted.
"""
from __future__ import annotations

import math
import statistics
import subprocess
import time
from dataclasses import dataclass, field

import torch

HEADSTART_CYCLES = 400_000  # ~200 us at 2 GHz: the least head start a sample gets
MAX_HEADSTART_CYCLES = 40_000_000  # ~20 ms: the most (a host-bound reference's launches may take longer)
CYCLES_PER_MS = 2_000_000  # SM cycles a millisecond at ~2 GHz (at lower clocks the spin only lasts longer)


def headstart_cycles(host_ms: float) -> int:
    """GPU spin cycles before a sample of a call whose host side (launches) takes ``host_ms``: twice that,
    within [HEADSTART_CYCLES, MAX_HEADSTART_CYCLES]. A fixed spin was too short beside a host-bound lane:
    in an A/B confirm with the torch reference (~6-10 ms of Python launches a call at gb10's shape), whose
    samples leave the GPU queue empty, the Triton bwd_bwd lane's median was 0.137 ms against its own
    0.080 ms minimum (its launches exposed; run 20261128T020607Z-mamba_bwd_bwd-h100-997). With a 2M-cycle
    spin for every call that noise went (IQR 0.021 -> 0.0009 ms) while the reference, whose launches
    outlast 1 ms, stayed noisy (results/logs/20261127T123200Z-call-confirm-noise-probe.txt). Sized per
    call, the reference's own spin covers its launches, so the queue stays ahead of both."""
    return int(min(MAX_HEADSTART_CYCLES, max(HEADSTART_CYCLES, math.ceil(2 * host_ms * CYCLES_PER_MS))))


@dataclass
class Timing:
    median_ms: float
    q1_ms: float
    q3_ms: float
    ci_half_ms: float        # half-width of the 95% CI of the median
    samples_ms: list[float] = field(default_factory=list)
    stop: str = ""           # "converged", "budget" or "max_samples"
    graph_ms: float | None = None
    graph_note: str = ""

    @property
    def iqr_ms(self) -> float:
        return self.q3_ms - self.q1_ms

    @property
    def n(self) -> int:
        return len(self.samples_ms)


def median_ci(samples: list[float]) -> tuple[float, float, float]:
    """(median, lower, upper) with a distribution-free 95% CI from binomial order statistics."""
    xs = sorted(samples)
    n = len(xs)
    med = statistics.median(xs)
    half = 1.96 * math.sqrt(n) / 2
    lo = max(0, int(math.floor(n / 2 - half)))
    hi = min(n - 1, int(math.ceil(n / 2 + half)))
    return med, xs[lo], xs[hi]


def quartiles(samples: list[float]) -> tuple[float, float]:
    if len(samples) < 2:
        return samples[0], samples[0]
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return q[0], q[2]


def sample_summary(samples: list[float], stop: str) -> dict:
    """Row fields (ms) of a list of samples timed elsewhere, e.g. one lane of an A/B run."""
    med, lo, hi = median_ci(samples)
    q1, q3 = quartiles(samples)
    return {"time_ms": med, "time_q1_ms": q1, "time_q3_ms": q3, "time_iqr_ms": q3 - q1,
            "time_ci_half_ms": (hi - lo) / 2, "samples": len(samples), "samples_ms": samples, "timing_stop": stop}


def gpu_clocks() -> dict:
    """Current SM and memory clocks in MHz via nvidia-smi (empty when unavailable)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem", "--format=csv,noheader,nounits",
                              "-i", "0"], capture_output=True, text=True, timeout=10).stdout.strip()
        sm, mem = (float(x) for x in out.splitlines()[0].split(","))
        return {"sm_mhz": sm, "mem_mhz": mem}
    except Exception:
        return {}


class _Clock:
    """Per-sample timer: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def sample(self, flush, fn, headstart: int = HEADSTART_CYCLES) -> object:
        if self.cuda:
            # Keep the GPU busy (a spin of ``headstart`` cycles) while the host enqueues flush and call,
            # so the host's launch cost (Python argument handling, descriptor set-up) never shows as an
            # idle gap inside the event interval: the events then bracket GPU execution only.
            torch.cuda._sleep(headstart)
            flush()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            return start, end
        flush()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def resolve(self, pending: list) -> list[float]:
        if not self.cuda:
            return pending
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in pending]


def bench(fn, device: str = "cuda", l2_bytes: int = 0, warmup_ms: float = 25.0, rel_ci: float = 0.01,
          min_samples: int = 10, max_samples: int = 2000, budget_ms: float = 3000.0, min_time_ms: float = 100.0,
          graph_below_ms: float = 0.02) -> Timing:
    """Time ``fn()`` (which launches the work). See the module docstring for the method.

    Sampling goes on for at least ``min_time_ms`` of kernel time, so that a fast kernel is not judged
    on a few milliseconds of one clock state (GPU clocks move with power draw over tens of ms).
    """
    timing = bench_interleaved([fn], device, l2_bytes, warmup_ms, rel_ci, min_samples, max_samples, budget_ms,
                               min_time_ms)[0]
    if device.startswith("cuda") and timing.median_ms < graph_below_ms:
        timing.graph_ms, timing.graph_note = _graph_time(fn, _flusher(device, l2_bytes))
    return timing


def _flusher(device: str, l2_bytes: int):
    if not device.startswith("cuda") or l2_bytes <= 0:
        return lambda: None
    buf = torch.empty(2 * l2_bytes, dtype=torch.uint8, device=device)
    return buf.zero_


def bench_interleaved(fns: list, device: str = "cuda", l2_bytes: int = 0, warmup_ms: float = 25.0,
                      rel_ci: float = 0.01, min_samples: int = 10, max_samples: int = 2000,
                      budget_ms: float = 3000.0, min_time_ms: float = 100.0) -> list[Timing]:
    """Time several calls in rounds, one sample of each per round, so that all of them see the same
    clock and thermal history; every other round runs them in reverse order (A B, B A, ...), so that
    a call's place in the round cannot bias the comparison (in fixed order, identical calls of a few
    tens of us can differ by percents). Stops when every median's 95% CI is within ``rel_ci``, each
    has ``min_time_ms`` of samples, or at the budget."""
    clock = _Clock(device)
    flush = _flusher(device, l2_bytes)
    # Time-based warm-up: compilation, module load and clocks ramping stay out of the samples. Its
    # fastest call's host time (launches only, once compiled) sizes each call's head start.
    host_ms = [math.inf] * len(fns)
    for i, fn in enumerate(fns):
        t_end = time.perf_counter() + warmup_ms / 1e3
        while True:
            t0 = time.perf_counter()
            fn()
            host_ms[i] = min(host_ms[i], (time.perf_counter() - t0) * 1e3)
            if time.perf_counter() >= t_end:
                break
    if clock.cuda:
        torch.cuda.synchronize()
    heads = [headstart_cycles(h) for h in host_ms]

    samples: list[list[float]] = [[] for _ in fns]
    deadline = time.perf_counter() + budget_ms / 1e3
    batch, stop, rounds = 5, "max_samples", 0
    while len(samples[0]) < max_samples:
        pending = [[] for _ in fns]
        for _ in range(batch):
            order = range(len(fns)) if rounds % 2 == 0 else range(len(fns) - 1, -1, -1)
            rounds += 1
            for i in order:
                pending[i].append(clock.sample(flush, fns[i], heads[i]))
        for i in range(len(fns)):
            samples[i] += clock.resolve(pending[i])
        if len(samples[0]) >= min_samples and all(sum(s) >= min_time_ms for s in samples):
            cis = [median_ci(s) for s in samples]
            if all(med > 0 and (hi - lo) / 2 <= rel_ci * med for med, lo, hi in cis):
                stop = "converged"
                break
        if time.perf_counter() > deadline:
            stop = "budget"
            break
        batch = min(50, batch * 2)
    out = []
    for s in samples:
        med, lo, hi = median_ci(s)
        q1, q3 = quartiles(s)
        out.append(Timing(med, q1, q3, (hi - lo) / 2, s, stop))
    return out


def _graph_time(fn, flush, reps: int = 50) -> tuple[float | None, str]:
    """Per-call time from CUDA-graph replays of (flush, fn) x reps minus flush x reps."""
    try:
        stream = torch.cuda.Stream()
        graphs = []
        for with_fn in (True, False):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                fn()  # warm the allocator/launcher on the capture stream
                torch.cuda.synchronize()
                with torch.cuda.graph(g, stream=stream):
                    for _ in range(reps):
                        flush()
                        if with_fn:
                            fn()
            graphs.append(g)
        times = []
        for g in graphs:
            g.replay()
            torch.cuda.synchronize()
            runs = []
            for _ in range(5):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                g.replay()
                e.record()
                torch.cuda.synchronize()
                runs.append(s.elapsed_time(e))
            times.append(statistics.median(runs))
        return max(0.0, (times[0] - times[1]) / reps), f"graph of {reps} calls, flush subtracted"
    except Exception as exc:  # capture unsupported by the lane: say so, keep the event timing
        return None, f"graph capture failed: {type(exc).__name__}: {exc}"[:200]
