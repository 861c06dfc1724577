"""GPU tests: the differential fuzz. Random configurations (tests/fuzz_configs.py) run on the
kernels and are compared with the NumPy reference.

A configuration is a cache layout and a few writes, decodes and dequantizes in random order, each
on one of four streams (the device's, two more non-blocking ones and the legacy default stream)
and ordered after the step before it by an event, so that the host waits only once, at the end.
Every buffer starts a random multiple of its alignment into an allocation of random bytes, all of
which, and every input, must be unchanged afterwards. After each write the pools are copied on its
stream and compared with the reference's pools byte for byte; decode outputs (poisoned with a bf16
NaN, as the split-K workspace is with a float NaN) are compared by relative error per head with the
float64 reference (1e-2) beyond the bound of the positions whose weight is below the sparse-V
threshold or too small for fp16 (fuzz_configs.FP16_SMALLEST_NORMAL); dequantized rows
byte for byte (NaN with NaN); in checked mode each step reports to an error word of its own, which
must hold exactly the flags of its bad slots, pages and lengths. The pools after the last step
must be the reference's.

64 tests of 80 configurations (5120 a run; FP8KTURBOV_FUZZ_SCALE=0.1 runs a tenth). Each test
prints its seed (FP8KTURBOV_TEST_SEED=<seed> replays its configurations) and a failure names the
configuration: FP8KTURBOV_FUZZ_CONFIG=<seed>[,<seed>...] runs just those, a test each
(test_replayed_configurations).
The small configurations (`-k small_configurations`, 128 of them) are those to run under
compute-sanitizer memcheck.
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest

import fp8kturbov
from conftest import relative_error_per_head
from fp8kturbov._device import stream_wait
from fuzz_configs import BF16, DecodeRun, DequantizeRun, FuzzCase, WriteRun, draw_config
from test_gpu_kernels import assert_pools_equal

pytestmark = pytest.mark.gpu

TESTS, CONFIGS_PER_TEST = 64, 80
SMALL_TESTS, SMALL_CONFIGS_PER_TEST = 8, 16
SCALE = float(os.environ.get("FP8KTURBOV_FUZZ_SCALE", "1"))
REPLAYED = os.environ.get("FP8KTURBOV_FUZZ_CONFIG")
REPLAYED_SEEDS = [int(seed) for seed in REPLAYED.split(",")] if REPLAYED else []
MARGIN_BYTES = 64  # random bytes after every buffer (and before it, its offset's)


@pytest.fixture(scope="module")
def device():
    from gpu_util import Device

    dev = Device()
    yield dev
    dev.free_all()


@pytest.fixture(scope="module")
def streams(device):
    """The handles a step's stream index picks from."""
    from gpu_util import check_driver_result, cu

    extra = [check_driver_result(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)) for _ in range(2)]
    yield [int(device.stream), *(int(s) for s in extra), 0]
    for stream in extra:
        check_driver_result(cu.cuStreamDestroy(stream))


def synchronize_all() -> None:
    from gpu_util import check_driver_result, cu

    check_driver_result(cu.cuCtxSynchronize())


class Placed:
    """``body`` uploaded ``offset`` bytes into an allocation whose other bytes (``offset`` before it,
    `MARGIN_BYTES` after) are random; ``address`` is the body's."""

    def __init__(self, device, rng: np.random.Generator, body: np.ndarray, offset: int) -> None:
        self.device, self.offset = device, offset
        self.body = np.ascontiguousarray(body).view(np.uint8).reshape(-1)
        self.image = np.concatenate([rng.integers(0, 256, offset, dtype=np.uint8), self.body,
                                     rng.integers(0, 256, MARGIN_BYTES, dtype=np.uint8)])
        self.base = self.device.upload(self.image)
        self.address = self.base + offset

    def download(self, what: str, base: int | None = None) -> np.ndarray:
        """The body's bytes in the allocation at ``base`` (this one, or a copy of it); asserts that
        the margins hold their bytes."""
        image = self.device.download(self.base if base is None else base, self.image)
        end = self.offset + self.body.size
        for name, part in (("before", slice(0, self.offset)), ("after", slice(end, None))):
            changed = np.flatnonzero(image[part] != self.image[part])
            assert changed.size == 0, f"{what}: {changed.size} bytes changed {name} it, first at {changed[:8].tolist()}"
        return image[self.offset:end]


def assert_bf16_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """bf16 bits equal, or both NaN (the kernels and NumPy may write NaN with other payloads)."""
    same = (got == want) | (np.isnan(got.view(BF16)) & np.isnan(want.view(BF16)))
    differ = np.flatnonzero(~same)
    assert differ.size == 0, f"{what}: {differ.size} elements differ, first at {differ[:8].tolist()}"


def check_decode_output(run: DecodeRun, got_bits: np.ndarray) -> None:
    got = got_bits.view(np.uint16).view(BF16).astype(np.float64).reshape(run.expected.shape)
    assert not np.isnan(got).any(), "an output element was left unwritten (poison NaN) or is NaN"
    empty = np.all(run.expected == 0, axis=-1)  # nothing attended (or V all zero): exactly zeros
    assert np.all(got[empty] == 0), "a row with nothing to attend must be zeros"
    err = relative_error_per_head(got, run.expected, allowance=run.bound)
    assert err.size == 0 or err.max() <= 1e-2, f"max relative error per head beyond the bound {err.max():.3g}"


class Launched:
    """One step's device buffers, its launch and, afterwards, its checks."""

    def __init__(self, device, rng: np.random.Generator, case: FuzzCase, run, pools: dict[str, Placed]) -> None:
        self.run, self.pools = run, pools
        self.buffers = {name: Placed(device, rng, array, run.step.offsets[name]) for name, array in run.buffers().items()}
        self.address = {name: placed.address for name, placed in {**pools, **self.buffers}.items()}
        self.word = fp8kturbov.ErrorWord(0) if case.config.layout.checked else None
        self.checked = case.checked_args(self.word.ptr if self.word else 0)
        self.extra = {}
        if isinstance(run, DecodeRun) and run.step.workspace != "none":
            nbytes = run.workspace_bytes(fp8kturbov.paged_decode_workspace_bytes(**run.plan_scalars()))
            workspace = Placed(device, rng, np.full(-(-nbytes // 4), np.nan, np.float32), run.step.offsets["workspace"])
            self.buffers["workspace"] = workspace
            self.extra["workspace"] = (workspace.address, nbytes)
        self.snapshots = {}
        if isinstance(run, WriteRun):  # the pools as this write leaves them, copied on its stream
            self.snapshots = {name: device.upload(np.zeros_like(pool.image)) for name, pool in pools.items()}

    def enqueue(self, stream: int) -> None:
        from gpu_util import check_driver_result, cu

        self.stream = stream
        self.run.launch(self.address, stream=stream, checked=self.checked, **self.extra)
        for name, copy in self.snapshots.items():
            pool = self.pools[name]
            check_driver_result(cu.cuMemcpyDtoDAsync(copy, pool.base, pool.image.nbytes, cu.CUstream(stream)))

    def check(self) -> None:
        run = self.run
        outputs = {DecodeRun: ("output",), DequantizeRun: ("key", "value"), WriteRun: ()}[type(run)]
        for name, placed in self.buffers.items():
            got = placed.download(name)
            if name not in outputs and name != "workspace":
                assert np.array_equal(got, placed.body), f"the input {name} changed"
        if isinstance(run, WriteRun):
            assert_pools_equal(self.pools["k_cache"].download("K pool", self.snapshots["k_cache"]),
                               run.expected_k_pool, "K pool")
            assert_pools_equal(self.pools["v_cache"].download("V pool", self.snapshots["v_cache"]),
                               run.expected_v_pool, "V pool")
        elif isinstance(run, DequantizeRun):
            assert_bf16_equal(self.buffers["key"].download("key").view(np.uint16), run.expected_key.reshape(-1), "key")
            assert_bf16_equal(self.buffers["value"].download("value").view(np.uint16), run.expected_value.reshape(-1),
                              "value")
        else:
            check_decode_output(run, self.buffers["output"].download("output"))
        if self.word is not None:
            flags = self.word.read(self.stream)
            assert flags == run.expected_flags, f"error word {flags!r}, expected {run.expected_flags!r}"


def run_case(device, streams: list[int], case: FuzzCase) -> None:
    rng = np.random.default_rng([case.config.seed, 2])  # the margins' bytes
    layout = case.config.layout
    pools = {"k_cache": Placed(device, rng, case.k_pool, layout.k_offset),
             "v_cache": Placed(device, rng, case.v_pool, layout.v_offset)}
    steps = [Launched(device, rng, case, run, pools) for run in case.runs]
    try:
        previous = None
        for step in steps:
            stream = streams[step.run.step.stream]
            if previous is not None and previous != stream:
                stream_wait(stream, previous)  # after the step before
            step.enqueue(stream)
            previous = stream
        synchronize_all()
        for index, step in enumerate(steps):
            try:
                step.check()
            except AssertionError as exc:
                raise AssertionError(f"step {index} ({type(step.run).__name__}): {exc}") from None
        assert_pools_equal(pools["k_cache"].download("K pool"), case.final_k_pool, "K pool after the last step")
        assert_pools_equal(pools["v_cache"].download("V pool"), case.final_v_pool, "V pool after the last step")
    finally:
        for step in steps:
            if step.word is not None:
                step.word.close()


def check_configuration(device, streams: list[int], seed: int, tally: Counter) -> None:
    """Run the configuration of ``seed``, counting it and its steps in ``tally``; a failure names
    it, and how to replay it."""
    config = draw_config(seed)
    try:
        case = FuzzCase(config)
        run_case(device, streams, case)
    except Exception as exc:
        raise AssertionError(f"configuration {seed} (FP8KTURBOV_FUZZ_CONFIG={seed} replays it): "
                             f"{type(exc).__name__}: {exc}\n{config}") from exc
    finally:
        synchronize_all()
        device.free_all()
    tally["configurations"] += 1
    for run in case.runs:
        tally[type(run).__name__] += 1
        tally["reported index errors"] += bool(run.expected_flags)


def check_configurations(device, streams: list[int], seeds: list[int]) -> None:
    """Run every configuration, then print what ran (one line, ``fuzz:``, for the run's totals)."""
    tally = Counter()
    for seed in seeds:
        check_configuration(device, streams, seed, tally)
    print(f"fuzz: {tally['configurations']} configurations, {tally['WriteRun']} writes, "
          f"{tally['DecodeRun']} decodes, {tally['DequantizeRun']} dequantizes, "
          f"{tally['reported index errors']} with index errors reported")


def configuration_seeds(rng: np.random.Generator, count: int) -> list[int]:
    return [int(seed) for seed in rng.integers(0, 2**63, size=max(1, round(count * SCALE)))]


@pytest.mark.skipif(REPLAYED is not None, reason="FP8KTURBOV_FUZZ_CONFIG runs the configurations named there")
@pytest.mark.parametrize("chunk", range(TESTS))
def test_random_configurations_match_reference(device, streams, rng, chunk):
    check_configurations(device, streams, configuration_seeds(rng, CONFIGS_PER_TEST))


@pytest.mark.skipif(REPLAYED is not None, reason="FP8KTURBOV_FUZZ_CONFIG runs the configurations named there")
@pytest.mark.parametrize("chunk", range(SMALL_TESTS))
def test_small_configurations_match_reference(device, streams, rng, chunk):
    """Configurations of the "small" size class only (few pages, short sequences, head_dim 64 and
    128): the share to run under compute-sanitizer."""
    seeds = configuration_seeds(rng, 10 * SMALL_CONFIGS_PER_TEST)  # a quarter of them are small
    small = [seed for seed in seeds if draw_config(seed).size == "small"][:max(1, round(SMALL_CONFIGS_PER_TEST * SCALE))]
    check_configurations(device, streams, small)


@pytest.mark.skipif(REPLAYED is None, reason="set FP8KTURBOV_FUZZ_CONFIG=<seed>[,<seed>...] to replay configurations")
@pytest.mark.parametrize("seed", REPLAYED_SEEDS or [None])  # without the variable: one test, skipped
def test_replayed_configurations(device, streams, seed):
    check_configurations(device, streams, [seed])
