"""NVML's view of a row's timing: the share of it during which a limit (power cap, temperature)
held the GPU's clocks down (`clock_limits_held`), and the board's mean power while a row's launches
run back to back (`mean_power_w`)."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from .nvml import NvmlCounters

if TYPE_CHECKING:
    from fp8kturbov._device import Device


# A row is marked where a limit held the GPU's clocks down for more than this share of its
# measuring time ("power cap N %", "thermal N %"): an issue-bound kernel runs slower for it.
CLOCK_LIMIT_NOTE = 0.01


@contextlib.contextmanager
def clock_limits_held(counters: NvmlCounters | None,
                      clock_ns: Callable[[], int] = time.perf_counter_ns) -> Iterator[dict[str, float]]:
    """Yields a dict that, once the block has run, holds per limit ("power cap", "thermal") the
    share (0 to 1) of the block's wall time (by ``clock_ns``) during which that limit held the
    GPU's clocks down. It stays empty where ``counters`` is None or NVML did not answer."""
    shares: dict[str, float] = {}
    before = counters.held_ns() if counters is not None else None
    start = clock_ns()
    yield shares
    if counters is None or before is None:
        return
    after = counters.held_ns()
    if after is not None:
        wall_ns = max(clock_ns() - start, 1)
        shares.update({name: min(1.0, (after[name] - before[name]) / wall_ns) for name in after})


def clock_limit_note(shares: dict[str, float]) -> str:
    """The note of the limits that held the clocks for more than `CLOCK_LIMIT_NOTE` of the time."""
    return ", ".join(f"{name} {100 * share:.0f} %" for name, share in shares.items() if share > CLOCK_LIMIT_NOTE)


#: NVML's energy counter moves in steps (about every 100 ms on an H200). A power reading waits
#: this long at most for its first step before it gives up (a counter that does not move).
ENERGY_STEP_TIMEOUT_S = 1.0
#: While power is measured, replays are queued in batches of at least this much GPU time (s), and
#: `POWER_QUEUE` batches ahead: a reading of NVML's energy counter takes milliseconds (3-5 ms on an
#: H200 host), during which fewer queued replays would leave the GPU idle.
POWER_BATCH_S = 0.02
POWER_QUEUE = 2


@dataclass(frozen=True)
class PowerProbe:
    """How a row's mean board power is measured: NVML's counters, and the seconds of the window."""

    counters: NvmlCounters
    window_s: float


def mean_power_w(dev: Device, replay: Callable[[], None], replay_us: float, probe: PowerProbe,
                 clock: Callable[[], float] = time.perf_counter) -> float | None:
    """The board's mean power (W) while ``replay`` (which enqueues on ``dev.stream`` work of about
    ``replay_us`` µs) runs back to back, in batches of `POWER_BATCH_S` and `POWER_QUEUE` batches
    ahead: the energy counter's growth from its first step to its first
    step at least ``probe.window_s`` seconds (by ``clock``) later, over the time between them. The
    load runs for a step before the window opens, so the window holds no ramp-up. None where the
    counter does not answer, or does not step within `ENERGY_STEP_TIMEOUT_S` (of the start, or of
    the window's end)."""
    per_batch = max(1, math.ceil(POWER_BATCH_S * 1e6 / replay_us))
    free, queued = list(dev.events(POWER_QUEUE)), []
    last = probe.counters.energy_mj()
    began = clock()
    start: tuple[float, int] | None = None  # (time, energy) of the window's first step
    power = None
    try:
        while last is not None:
            while free:
                for _ in range(per_batch):
                    replay()
                dev.record(free[-1])
                queued.append(free.pop())
            if dev.done(queued[0]):
                free.append(queued.pop(0))
                continue
            now, energy = clock(), probe.counters.energy_mj()
            if energy is not None and energy != last:
                if start is None:
                    start = (now, energy)
                elif now - start[0] >= probe.window_s:
                    power = (energy - start[1]) / 1e3 / (now - start[0])
                    break
            else:
                # The first step is due within the timeout of the start, the closing one of the window's end.
                due = began if start is None else start[0] + probe.window_s
                if energy is None or now > due + ENERGY_STEP_TIMEOUT_S:
                    break  # the counter stopped answering, or stepping
            last = energy
    finally:
        dev.synchronize()
    return power


def energy_mj(power_w: float | None, launch_us: float | None) -> float | None:
    """Energy per launch (mJ) at ``power_w`` for a launch of ``launch_us`` µs; None if either is."""
    return None if power_w is None or launch_us is None else power_w * launch_us * 1e-3
