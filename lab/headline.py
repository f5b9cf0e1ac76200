"""Which A/B confirm stands for a lane's best config (the report's headline, the export's pick).

A lane's confirm re-times its best config interleaved with the other lanes; it stands for the lane
until a later sweep finds a config clearly faster than the confirmed one. "Clearly" compares the two
configs' fastest sweep trials, not a sweep median with a confirm median: the two methods differed by
up to 3.8x for the same config (the host-bound reference beside a lane, before each call's GPU head
start was sized by its host time), while the fastest trials of one config in repeated sweeps of the
same code were within 5% of each other in 90% of the cases (results/ as of 2026-11-28; their slower
trials reach 1.7x, which a comparison of the fastest ones does not see).
"""
from __future__ import annotations

import pandas as pd

SUPERSEDE = 0.10   # fraction: a sweep trial this much faster than the confirmed config's fastest one supersedes it


def standing_confirm(confirms: pd.DataFrame, sweeps: pd.DataFrame) -> pd.Series | None:
    """The confirm row that stands for a lane among its candidate rows, or None.

    ``confirms`` / ``sweeps``: the lane's ok confirm and sweep rows at one shape and device (time_ms in
    ms). The fastest confirm (earliest on a tie) stands unless the fastest sweep trial is more than
    SUPERSEDE faster than the confirmed config's own fastest sweep trial; a confirmed config with no
    sweep row among the candidates keeps its confirm (nothing to compare with the same method)."""
    if confirms.empty:
        return None
    c = confirms.sort_values(["time_ms", "time_utc"]).iloc[0]
    own = sweeps.loc[sweeps["config_json"] == c["config_json"], "time_ms"]
    if own.empty or sweeps["time_ms"].min() >= (1 - SUPERSEDE) * own.min():
        return c
    return None
