"""Many host threads launching at once: results equal to serial runs, error messages per thread.

GPU tests (marked ``gpu``): host threads, each with its own non-blocking stream in the primary
context of its GPU, launch writes and decodes at the same time; every cache byte and every output
element must equal, bit for bit, the same work done serially on one stream of the same GPU (a
decode is deterministic for a given shape, device and workspace size). The serial runs are checked
against the NumPy reference, so the comparison is not between two equally wrong results. Inputs are
fresh random values; pools start as random bytes and outputs as a bf16 NaN.

The CPU test has threads provoke different validation errors at once: each must see its own
message, through Python and through ``fp8kturbov_last_error_message()``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest

import fp8kturbov
from conftest import relative_error_per_head, shuffled_block_tables
from fp8kturbov import reference as ref
from fp8kturbov._lib import lib

try:
    from cuda.bindings import driver as cu
    from gpu_util import check_driver_result as _check
except ImportError:  # the gpu tests are skipped (conftest); the CPU test needs no driver
    cu = None

BF16 = ml_dtypes.bfloat16
POISON = 0x7FC1  # a bf16 NaN: an output element still holding it was not written
NUM_THREADS = 8
ROUNDS = 5       # write + decode steps per job
REPEATS = 3      # times each thread runs its job, all enqueued before the first result is read
K_SCALE = 0.05
#: (V bits, head dim) of the jobs, so that different kernels run side by side.
SHAPES = [(2, 64), (3, 128), (4, 256), (3, 512), (4, 64), (2, 128), (3, 256), (2, 512)]
BARRIER_TIMEOUT_S = 120


# ---- Host threads and streams ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def contexts():
    """The primary context of every visible GPU, retained for the module; GPU 0's is current on
    the main thread."""
    _check(cu.cuInit(0))
    devices = [_check(cu.cuDeviceGet(i)) for i in range(_check(cu.cuDeviceGetCount()))]
    retained = [_check(cu.cuDevicePrimaryCtxRetain(device)) for device in devices]
    _check(cu.cuCtxSetCurrent(retained[0]))
    yield retained
    for device in devices:
        cu.cuDevicePrimaryCtxRelease(device)


class StreamRunner:
    """A non-blocking stream of ``context`` (made current on the calling thread) and the device
    buffers made through it. Every copy is ordered on that stream, so no other thread's work is
    waited for."""

    def __init__(self, context) -> None:
        self.context = context
        _check(cu.cuCtxSetCurrent(context))
        self.stream = _check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        self._buffers: list[Any] = []

    def __enter__(self) -> StreamRunner:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        # Cleanup ignores CUDA errors: it also runs while an earlier error propagates.
        cu.cuCtxSetCurrent(self.context)
        cu.cuStreamSynchronize(self.stream)
        for ptr in self._buffers:
            cu.cuMemFree(ptr)
        cu.cuStreamDestroy(self.stream)

    def alloc(self, nbytes: int) -> int:
        ptr = _check(cu.cuMemAlloc(max(nbytes, 1)))
        self._buffers.append(ptr)
        return int(ptr)

    def copy_in(self, address: int, host: np.ndarray) -> None:
        """Enqueue a copy of ``host`` (contiguous) to ``address`` (pageable memory is staged
        before the call returns)."""
        assert host.flags.c_contiguous
        if host.nbytes:
            _check(cu.cuMemcpyHtoDAsync(address, host.ctypes.data, host.nbytes, self.stream))

    def upload(self, host: np.ndarray) -> int:
        ptr = self.alloc(host.nbytes)
        self.copy_in(ptr, host)
        return ptr

    def download(self, address: int, like: np.ndarray) -> np.ndarray:
        self.synchronize()
        out = np.empty_like(like)
        if out.nbytes:
            _check(cu.cuMemcpyDtoHAsync(out.ctypes.data, address, out.nbytes, self.stream))
        self.synchronize()
        return out

    def synchronize(self) -> None:
        _check(cu.cuStreamSynchronize(self.stream))


def run_on_threads(tasks: list[Callable[[threading.Barrier], Any]]) -> list[Any]:
    """Run each ``task(start)`` on its own host thread. A task sets up, then waits on ``start``,
    so that all launch at once. Returns the results in order; re-raises a task's failure (the
    first that is not a broken barrier, which only follows another task's failure)."""
    start = threading.Barrier(len(tasks), timeout=BARRIER_TIMEOUT_S)
    results: list[Any] = [None] * len(tasks)
    errors: list[BaseException | None] = [None] * len(tasks)

    def body(index: int) -> None:
        try:
            results[index] = tasks[index](start)
        except BaseException as exc:  # reported in the main thread
            errors[index] = exc
            start.abort()

    threads = [threading.Thread(target=body, args=(i,), name=f"launcher-{i}") for i in range(len(tasks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failures = [e for e in errors if e is not None]
    if failures:
        raise next((e for e in failures if not isinstance(e, threading.BrokenBarrierError)), failures[0])
    return results


# ---- One thread's work: a cache that rounds of writes grow, a decode after each -------------------


def bf16_rows(rng, num_rows: int, stride: int, row_elems: int) -> np.ndarray:
    """bf16 ``[num_rows, stride]``: N(0, 1) data, NaN padding beyond ``row_elems``."""
    rows = np.full((num_rows, stride), np.nan, dtype=np.float32)
    rows[:, :row_elems] = rng.standard_normal((num_rows, row_elems))
    return rows.astype(BF16)


@dataclass
class Result:
    k_pool: np.ndarray
    v_pool: np.ndarray
    output: np.ndarray  # uint16 (bf16 bits) [ROUNDS, num_seqs, num_q_heads, head_dim]


class Job:
    """``ROUNDS`` decode steps of four sequences: round 0 writes a prefill of each, every later
    round one token more, each round ends with a decode of all of them into its own output rows.
    Sequence 0 stays empty (seq_len 0; its token each round is a padding slot, -1). Pools start as
    random bytes; page tables are shuffled."""

    num_kv_heads, group_size, block_size, num_seqs = 2, 4, 16, 4

    def __init__(self, rng, bits: int, head_dim: int) -> None:
        self.bits, self.head_dim = bits, head_dim
        self.num_q_heads = self.num_kv_heads * self.group_size
        self.n = n = self.num_kv_heads * head_dim
        B = self.block_size
        prefill = rng.integers(1, 150, size=self.num_seqs)
        prefill[0] = 0
        final = np.where(np.arange(self.num_seqs) == 0, 0, prefill + ROUNDS - 1)
        blocks = -(-final // B)
        self.max_blocks_per_seq = int(blocks.max()) + 1
        self.num_blocks = int(blocks.sum()) + 2  # two pages no sequence uses
        self.block_tables = shuffled_block_tables(rng, blocks, self.num_blocks, self.max_blocks_per_seq)

        self.k_stride = ref.k_page_bytes(B, self.num_kv_heads, head_dim)
        self.v_data = ref.v_data_section_bytes(B, self.num_kv_heads, head_dim, bits)
        self.v_stride = ref.v_page_bytes(B, self.num_kv_heads, head_dim, bits)
        self.k_pool = rng.integers(0, 256, self.num_blocks * self.k_stride, dtype=np.uint8)
        self.v_pool = rng.integers(0, 256, self.num_blocks * self.v_stride, dtype=np.uint8)
        self.q_stride = self.num_q_heads * head_dim + 8
        self.inv_sqrt_d = float(head_dim**-0.5)

        self.slots, self.keys, self.values, self.seq_lens, self.queries = [], [], [], [], []
        for r in range(ROUNDS):
            # Round 0: every position of the prefill; later rounds: the next position.
            positions = {s: range(prefill[s]) if r == 0 else [prefill[s] + r - 1]
                         for s in range(1, self.num_seqs)}
            slots = [int(self.block_tables[s, p // B]) * B + p % B for s, ps in positions.items() for p in ps]
            slots = rng.permutation(np.array(slots + [-1], dtype=np.int64))  # -1: sequence 0
            self.slots.append(slots)
            self.keys.append(bf16_rows(rng, len(slots), n, n))
            self.values.append(bf16_rows(rng, len(slots), n, n))
            self.seq_lens.append(np.where(np.arange(self.num_seqs) == 0, 0, prefill + r).astype(np.int32))
            self.queries.append(bf16_rows(rng, self.num_seqs, self.q_stride, self.num_q_heads * head_dim))
        self.out_poison = np.full((ROUNDS, self.num_seqs, self.num_q_heads, head_dim), POISON,
                                  dtype=np.uint16)

    def layout(self) -> dict[str, Any]:
        return dict(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, block_size=self.block_size,
                    k_scale=K_SCALE, v_bits=self.bits, k_block_stride_bytes=self.k_stride,
                    v_block_stride_bytes=self.v_stride, v_data_section_bytes=self.v_data)

    def decode_scalars(self) -> dict[str, Any]:
        return dict(self.layout(), max_blocks_per_seq=self.max_blocks_per_seq, num_seqs=self.num_seqs,
                    num_q_heads=self.num_q_heads, inv_sqrt_d=self.inv_sqrt_d, q_stride=self.q_stride,
                    sliding_window=0, sparse_v_threshold=0.0)

    def reference(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Final pools and float64 outputs ``[ROUNDS, num_seqs, num_q_heads, head_dim]``."""
        k_pool, v_pool = self.k_pool.copy(), self.v_pool.copy()
        outputs = []
        for r in range(ROUNDS):
            ref.write_cache(self.keys[r], self.values[r], k_pool, v_pool, self.slots[r], len(self.slots[r]),
                            self.num_kv_heads, self.head_dim, self.block_size, self.n, self.n, K_SCALE,
                            self.k_stride, self.v_stride, self.v_data, self.bits)
            outputs.append(ref.paged_decode(
                self.queries[r], k_pool, v_pool, self.block_tables, self.seq_lens[r], self.max_blocks_per_seq,
                self.num_seqs, self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size,
                self.inv_sqrt_d, K_SCALE, self.q_stride, self.v_stride, self.v_data, 0, self.bits,
                k_block_stride_bytes=self.k_stride))
        return k_pool, v_pool, np.stack(outputs)


class Launches:
    """A job's buffers on one stream (allocated and filled on the calling thread), and the launches
    of all its rounds."""

    def __init__(self, job: Job, runner: StreamRunner) -> None:
        self.job, self.runner = job, runner
        self.k_cache = runner.alloc(job.k_pool.nbytes)
        self.v_cache = runner.alloc(job.v_pool.nbytes)
        self.output = runner.alloc(job.out_poison.nbytes)
        self.round_bytes = job.out_poison[0].nbytes
        # Split over CTAs where that helps; the plan (and so the result) is a function of the
        # shape, the device and this workspace size, the same in the serial and concurrent runs.
        self.workspace_bytes = fp8kturbov.paged_decode_workspace_bytes(**job.decode_scalars())
        self.workspace_poison = np.full(self.workspace_bytes // 4, np.nan, dtype=np.float32)
        self.workspace = runner.alloc(self.workspace_bytes)
        self.block_tables = runner.upload(job.block_tables)
        self.rounds = [tuple(runner.upload(a) for a in (
                           job.keys[r].view(np.uint16), job.values[r].view(np.uint16), job.slots[r],
                           job.seq_lens[r], job.queries[r].view(np.uint16)))
                       for r in range(ROUNDS)]

    def enqueue(self) -> None:
        """Reset the pools, output and workspace, then launch every round; nothing waits."""
        job, runner = self.job, self.runner
        runner.copy_in(self.k_cache, job.k_pool)
        runner.copy_in(self.v_cache, job.v_pool)
        runner.copy_in(self.output, job.out_poison)
        runner.copy_in(self.workspace, self.workspace_poison)
        for r, (key, value, slots, seq_lens, q) in enumerate(self.rounds):
            fp8kturbov.reshape_and_cache(
                key, value, self.k_cache, self.v_cache, slots, num_tokens=len(job.slots[r]),
                key_stride=job.n, value_stride=job.n, stream=runner.stream, **job.layout())
            fp8kturbov.paged_decode_attn(
                q, self.k_cache, self.v_cache, self.output + r * self.round_bytes, self.block_tables,
                seq_lens, workspace=self.workspace, workspace_bytes=self.workspace_bytes,
                stream=runner.stream, **job.decode_scalars())

    def result(self) -> Result:
        job, runner = self.job, self.runner
        return Result(runner.download(self.k_cache, job.k_pool), runner.download(self.v_cache, job.v_pool),
                      runner.download(self.output, job.out_poison))


def assert_same(got: Result, want: Result, what: str) -> None:
    for name in ("k_pool", "v_pool", "output"):
        differ = np.flatnonzero(getattr(got, name) != getattr(want, name))
        assert differ.size == 0, (f"{what}: {name}: {differ.size} elements differ from the serial run, "
                                  f"first at flat index {differ[:8].tolist()}")


def assert_matches_reference(job: Job, got: Result, what: str) -> None:
    want_k, want_v, want_out = job.reference()
    assert np.array_equal(got.k_pool, want_k), f"{what}: K pool differs from the reference"
    assert np.array_equal(got.v_pool, want_v), f"{what}: V pool differs from the reference"
    out = got.output.view(BF16).astype(np.float64)
    assert not np.isnan(out).any(), f"{what}: an output element was left unwritten (poison NaN)"
    assert np.all(out[:, 0] == 0), f"{what}: sequence 0 (seq_len 0) must give zeros"
    err = relative_error_per_head(out, want_out)
    assert err.max() <= 1e-2, f"{what}: max relative error per head {err.max():.3g}"


def run_serially(jobs: list[Job], devices: list[int], contexts) -> list[Result]:
    """Each job after the other on one stream of its GPU (one stream per GPU)."""
    results: dict[int, Result] = {}
    for device in sorted(set(devices)):
        with StreamRunner(contexts[device]) as runner:
            for index, job in enumerate(jobs):
                if devices[index] == device:
                    launches = Launches(job, runner)
                    launches.enqueue()
                    results[index] = launches.result()
    _check(cu.cuCtxSetCurrent(contexts[0]))
    return [results[i] for i in range(len(jobs))]


@pytest.mark.gpu
@pytest.mark.parametrize("num_gpus", [1, 2], ids=["one_gpu", "two_gpus"])
def test_threads_on_their_own_streams_match_serial_runs(contexts, rng, num_gpus):
    """``NUM_THREADS`` threads, each with its own stream and job (job i on GPU i % num_gpus), all
    released at once; each enqueues its job ``REPEATS`` times before reading any result."""
    if len(contexts) < num_gpus:
        pytest.skip(f"needs {num_gpus} GPUs, {len(contexts)} visible")
    jobs = [Job(rng, *SHAPES[i % len(SHAPES)]) for i in range(NUM_THREADS)]
    devices = [i % num_gpus for i in range(NUM_THREADS)]

    serial = run_serially(jobs, devices, contexts)
    for index, (job, result) in enumerate(zip(jobs, serial)):
        assert_matches_reference(job, result, f"serial job {index} ({job.bits} bits, D {job.head_dim})")

    def task(index: int) -> Callable[[threading.Barrier], list[Result]]:
        def run(start: threading.Barrier) -> list[Result]:
            with StreamRunner(contexts[devices[index]]) as runner:
                launches = [Launches(jobs[index], runner) for _ in range(REPEATS)]
                runner.synchronize()
                start.wait()
                for each in launches:
                    each.enqueue()
                return [each.result() for each in launches]
        return run

    concurrent = run_on_threads([task(i) for i in range(NUM_THREADS)])
    for index, repeats in enumerate(concurrent):
        for repeat, result in enumerate(repeats):
            assert_same(result, serial[index], f"thread {index} (GPU {devices[index]}), repeat {repeat}")


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_threads_writing_disjoint_slots_of_one_pool_match_a_serial_write(contexts, rng, bits, head_dim):
    """One pool, ``NUM_THREADS`` threads writing at once: slot s belongs to thread s %
    NUM_THREADS, so neighbouring rows of a page (and their V scale bytes, which share words) are
    written by different threads. Each thread writes its slots in three launches on its own stream,
    each with a padding slot; a quarter of the slots stays unwritten (random bytes)."""
    num_kv_heads, block_size, num_blocks = 1, 16, 16
    n = num_kv_heads * head_dim
    num_slots = num_blocks * block_size
    layout = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, k_scale=K_SCALE,
                  v_bits=bits, k_block_stride_bytes=ref.k_page_bytes(block_size, num_kv_heads, head_dim),
                  v_block_stride_bytes=ref.v_page_bytes(block_size, num_kv_heads, head_dim, bits),
                  v_data_section_bytes=ref.v_data_section_bytes(block_size, num_kv_heads, head_dim, bits))
    k_pool = rng.integers(0, 256, num_blocks * layout["k_block_stride_bytes"], dtype=np.uint8)
    v_pool = rng.integers(0, 256, num_blocks * layout["v_block_stride_bytes"], dtype=np.uint8)
    written = rng.permutation(num_slots)[:num_slots * 3 // 4]
    # chunks[thread] = [(slots, keys, values), ...]
    chunks = []
    for thread in range(NUM_THREADS):
        mine = written[written % NUM_THREADS == thread]
        chunks.append([])
        for part in np.array_split(mine, 3):
            slots = rng.permutation(np.append(part, -1).astype(np.int64))
            chunks[-1].append((slots, bf16_rows(rng, len(slots), n, n), bf16_rows(rng, len(slots), n, n)))

    want_k, want_v = k_pool.copy(), v_pool.copy()
    for slots, keys, values in (chunk for mine in chunks for chunk in mine):
        ref.write_cache(keys, values, want_k, want_v, slots, len(slots), num_kv_heads, head_dim, block_size,
                        n, n, K_SCALE, layout["k_block_stride_bytes"], layout["v_block_stride_bytes"],
                        layout["v_data_section_bytes"], bits)

    def prepare(runner: StreamRunner, k_cache: int, v_cache: int, mine) -> Callable[[], None]:
        """Upload one thread's chunks through ``runner``; returns what enqueues their writes."""
        uploaded = [(runner.upload(s), runner.upload(k.view(np.uint16)), runner.upload(v.view(np.uint16)),
                     len(s)) for s, k, v in mine]

        def launch() -> None:
            for slots, key, value, count in uploaded:
                fp8kturbov.reshape_and_cache(key, value, k_cache, v_cache, slots, num_tokens=count,
                                             key_stride=n, value_stride=n, stream=runner.stream, **layout)
        return launch

    with StreamRunner(contexts[0]) as main:
        k_cache, v_cache = main.upload(k_pool), main.upload(v_pool)
        for mine in chunks:  # serially, one stream
            prepare(main, k_cache, v_cache, mine)()
        serial = (main.download(k_cache, k_pool), main.download(v_cache, v_pool))
        assert np.array_equal(serial[0], want_k), "serial write: K pool differs from the reference"
        assert np.array_equal(serial[1], want_v), "serial write: V pool differs from the reference"

        def task(thread: int) -> Callable[[threading.Barrier], None]:
            def run(start: threading.Barrier) -> None:
                with StreamRunner(contexts[0]) as runner:
                    launch = prepare(runner, k_cache, v_cache, chunks[thread])
                    runner.synchronize()
                    start.wait()
                    launch()
                    runner.synchronize()
            return run

        for repeat in range(REPEATS):
            main.copy_in(k_cache, k_pool)
            main.copy_in(v_cache, v_pool)
            main.synchronize()
            run_on_threads([task(t) for t in range(NUM_THREADS)])
            got_k, got_v = main.download(k_cache, k_pool), main.download(v_cache, v_pool)
            for name, got, want in (("K", got_k, serial[0]), ("V", got_v, serial[1])):
                differ = np.flatnonzero(got != want)
                assert differ.size == 0, (f"repeat {repeat}: {name} pool: {differ.size} bytes differ from "
                                          f"the serial write, first at {differ[:8].tolist()}")


# ---- Last-error messages under concurrency (CPU) ----------------------------------------------------


def _zero_work_args(op: str) -> dict[str, Any]:
    """Valid arguments of ``op`` with NULL pointers and no work (packed 3-bit pages, 2 KV heads of
    128): a successful call that launches nothing."""
    block_size, num_kv_heads, head_dim, bits = 16, 2, 128, 3
    n = num_kv_heads * head_dim
    args: dict[str, Any] = dict(
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, k_scale=1.0, v_bits=bits,
        k_block_stride_bytes=ref.k_page_bytes(block_size, num_kv_heads, head_dim),
        v_block_stride_bytes=ref.v_page_bytes(block_size, num_kv_heads, head_dim, bits),
        v_data_section_bytes=ref.v_data_section_bytes(block_size, num_kv_heads, head_dim, bits))
    if op in ("reshape_and_cache", "dequantize"):
        pointers = ["key", "value", "k_cache", "v_cache", "slot_mapping"]
        args.update(dict.fromkeys(pointers, 0), num_tokens=0, key_stride=n, value_stride=n)
    else:
        if op == "paged_decode_attn":
            args.update(dict.fromkeys(["q", "k_cache", "v_cache", "output", "block_tables", "seq_lens"], 0))
        args.update(max_blocks_per_seq=4, num_seqs=0, num_q_heads=4 * num_kv_heads,
                    inv_sqrt_d=head_dim**-0.5, q_stride=4 * n)
    return args


def _failing_call(index: int) -> tuple[str, dict[str, Any], str]:
    """Thread ``index``'s own failing call: an entry point, arguments breaking one rule with a value
    no other thread uses, and the text its message must contain."""
    op = ("reshape_and_cache", "dequantize", "paged_decode_attn", "paged_decode_workspace_bytes")[index % 4]
    args = _zero_work_args(op)
    if op == "reshape_and_cache":
        args["head_dim"] = 16 * index + 8
        text = f"head_dim = {args['head_dim']} is not a positive multiple of 16"
    elif op == "dequantize":
        args["k_scale"] = -float(index + 1)
        text = f"k_scale = {args['k_scale']:g} must be finite and positive"
    elif op == "paged_decode_attn":
        args["q_stride"] = args["num_q_heads"] * args["head_dim"] - (index + 1)
        text = f"q_stride = {args['q_stride']} is smaller than"
    else:
        args["num_q_heads"] = 2 * index + 1  # not a multiple of num_kv_heads = 2
        text = f"num_q_heads = {args['num_q_heads']} is not a positive multiple of num_kv_heads = 2"
    return op, args, text


def test_last_error_message_is_per_thread_under_concurrency():
    """32 threads, released at once, each alternate 200 times between its own failing call and a
    successful zero-work call: a failure's message is the thread's own (through the exception and
    through C), and a success leaves an empty message, whatever the other threads do meanwhile."""
    num_threads, iterations = 32, 200

    def task(index: int) -> Callable[[threading.Barrier], list[str]]:
        op, bad_args, text = _failing_call(index)
        good_op = ("reshape_and_cache", "dequantize", "paged_decode_attn")[index % 3]
        good_args = _zero_work_args(good_op)
        function, good = getattr(fp8kturbov, op), getattr(fp8kturbov, good_op)

        def run(start: threading.Barrier) -> list[str]:
            problems: list[str] = []
            start.wait()
            first = None
            for _ in range(iterations):
                try:
                    function(**bad_args)
                    problems.append(f"{op} accepted {text!r}")
                    continue
                except fp8kturbov.InvalidValueError as error:
                    message = error.message
                first = first or message
                seen = lib.fp8kturbov_last_error_message().decode()
                if not message.startswith(f"fp8kturbov_{op}: ") or text not in message or message != first:
                    problems.append(f"message {message!r}, want fp8kturbov_{op}: ... {text!r}")
                if seen != message:
                    problems.append(f"last error {seen!r} after the failure {message!r}")
                good(**good_args)
                seen = lib.fp8kturbov_last_error_message().decode()
                if seen:
                    problems.append(f"last error {seen!r} after a successful {good_op}")
            return problems

        return run

    results = run_on_threads([task(i) for i in range(num_threads)])
    problems = [f"thread {i}: {p}" for i, found in enumerate(results) for p in found]
    assert not problems, f"{len(problems)} problems, first: {problems[:4]}"
