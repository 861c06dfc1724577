"""How a launch is timed: event-timed samples queued behind the device's gate (`time_launches`), one
CUDA graph per input set replayed (`time_graphs`), a graph of `GRAPH_CHAIN` launches for the
in-graph time (`time_graph_chain`), and the read kernel of the ceiling over a row's bytes
(`time_plain_read`)."""

from __future__ import annotations

import dataclasses
import functools
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from . import kernels
from .config import Config, fits_in_memory
from .kernels import READ_ALIGNMENT
from .power import PowerProbe, mean_power_w

if TYPE_CHECKING:
    from fp8kturbov._device import Device

#: Launches per graph for the in-graph time. An engine captures a whole decode step (every layer's
#: write and decode) in one graph, where a launch costs a graph node rather than a graph launch.
#: A sample of the chain averages this many launches, so it gets a quarter of `Config.iters`.
GRAPH_CHAIN = 32
READ_CTAS_PER_SM = 8  # CTAs of the read kernel per SM: 2048 threads, a full SM
#: Samples queued behind one gate. Kept small: were the launch queue to fill while the stream
#: waits, the host would block inside a launch and never open the gate.
GATE_CHUNK = 32


@dataclass(frozen=True)
class Timing:
    """Per-launch times of one case, µs; ``set_medians_us``: the median of each input set's
    samples (sample ``i`` is of set ``i mod sets``)."""

    median_us: float
    min_us: float
    samples: int
    set_medians_us: tuple[float, ...] = ()
    power_w: float | None = None  # the board's mean power while the launches ran (`mean_power_w`)

    @classmethod
    def of(cls, samples_us: Sequence[float], sets: int = 1) -> Timing:
        return cls(statistics.median(samples_us), min(samples_us), len(samples_us),
                   tuple(statistics.median(samples_us[k::sets]) for k in range(min(sets, len(samples_us)))))

    def per_launch(self, launches: int) -> Timing:
        """The times of samples that each ran ``launches`` launches, per launch."""
        return Timing(self.median_us / launches, self.min_us / launches, self.samples,
                      tuple(t / launches for t in self.set_medians_us))

    def set_spread(self) -> float:
        """How far apart the input sets' medians are: the slowest over the fastest, minus 1."""
        return max(self.set_medians_us) / min(self.set_medians_us) - 1.0 if self.set_medians_us else 0.0


def time_launches(dev: Device, launches: Sequence[Callable[[], None]], iters: int,
                  warmup: int, gate_chunk: int = GATE_CHUNK, power: PowerProbe | None = None) -> Timing:
    """Per-launch times, µs: ``warmup`` untimed launches, then ``iters`` event-timed samples,
    sample ``i`` being ``launches[i % len(launches)]()`` (which must enqueue on ``dev.stream``),
    ``gate_chunk`` of them queued behind each gate. With ``power``, then the mean power of
    ``launches[0]`` back to back (`mean_power_w`)."""
    for i in range(warmup):
        launches[i % len(launches)]()
    dev.synchronize()
    events = dev.events(2 * iters)
    for first in range(0, iters, gate_chunk):
        with dev.gate():
            for i in range(first, min(first + gate_chunk, iters)):
                dev.record(events[2 * i])
                launches[i % len(launches)]()
                dev.record(events[2 * i + 1])
    dev.synchronize()
    timing = Timing.of([dev.elapsed_us(events[2 * i], events[2 * i + 1]) for i in range(iters)], len(launches))
    if power is not None:
        timing = dataclasses.replace(timing, power_w=mean_power_w(dev, launches[0], timing.median_us, power))
    return timing


def chain_graph(dev: Device, enqueues: Sequence[Callable[[], None]]) -> Any:
    """One CUDA graph of `GRAPH_CHAIN` launches back to back, launch ``i`` from
    ``enqueues[i % len(enqueues)]``."""
    def chain() -> None:
        for i in range(GRAPH_CHAIN):
            enqueues[i % len(enqueues)]()

    return dev.capture(chain)


def time_graph_chain(dev: Device, enqueues: Sequence[Callable[[], None]], iters: int,
                     warmup: int) -> Timing:
    """Per-launch times, µs, inside a `chain_graph`: `time_launches` of its replays, each sample
    divided by `GRAPH_CHAIN`. Assumes ``enqueues`` ran once already (`time_graphs` does that)."""
    graph = chain_graph(dev, enqueues)
    # One replay per gate: it queues as many kernels as a gate's chunk of single launches.
    timing = time_launches(dev, [functools.partial(dev.launch, graph)], iters, warmup,
                           gate_chunk=max(1, GATE_CHUNK // GRAPH_CHAIN))
    return timing.per_launch(GRAPH_CHAIN)


def time_graphs(dev: Device, enqueues: Sequence[Callable[[], None]], iters: int,
                warmup: int) -> Timing:
    """`time_launches` of CUDA-graph replays of each ``enqueue`` (one graph per input set)."""
    for enqueue in enqueues:  # once outside capture: argument checks and lazy set-up
        enqueue()
    dev.synchronize()
    graphs = [dev.capture(enqueue) for enqueue in enqueues]
    return time_launches(dev, [functools.partial(dev.launch, g) for g in graphs], iters, warmup)


def read_enqueue(dev: Device, src: int, nbytes: int, sink: int) -> Callable[[], None]:
    """Enqueues the bench's read kernel over ``nbytes`` at ``src`` on ``dev.stream``, with
    `READ_CTAS_PER_SM` CTAs per SM; ``sink``: a writable 4-byte word (`kernels.read`)."""
    ctas = READ_CTAS_PER_SM * dev.attribute("MULTIPROCESSOR_COUNT")
    return functools.partial(kernels.read, int(dev.stream), src, nbytes, sink, ctas)


def time_plain_read(dev: Device, nbytes: int, config: Config) -> float | None:
    """µs of the ceiling's read kernel over ``nbytes`` (rounded up to `READ_ALIGNMENT`), one
    launch per graph replay, rotating ``config.sets`` buffers as a row rotates its input sets
    (median of ``config.iters``); None where those buffers do not fit in the free memory."""
    n = -(-nbytes // READ_ALIGNMENT) * READ_ALIGNMENT
    free, _ = dev.memory()
    if not fits_in_memory(config.sets * n, free):
        return None
    with dev.scope():
        sink, buffers = dev.alloc(4), [dev.alloc(n) for _ in range(config.sets)]
        for buffer in buffers:
            dev.memset(buffer, 1, n)
        reads = [read_enqueue(dev, buffer, n, sink) for buffer in buffers]
        return time_graphs(dev, reads, config.iters, config.warmup).median_us
