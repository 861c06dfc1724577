"""Benchmark harness: paged decode and cache write against the device's memory roofline, and the
paged prefill against flashinfer's BF16 prefill.

Run it as ``python -m fp8kturbov bench`` (``--help`` lists the options) or call
`run.run_benchmarks`. Everything is measured in one process on one GPU, through cuda.bindings
(driver API) alone; torch is imported only for the BF16 peer and flashinfer only for the FP8 peer.
The driver calls and `Device` live in `fp8kturbov._device`.

Modules: `config` (what to run: `Config`, the cases, their bytes), `launches` (the library's
launches of a case), `timing` (CUDA-graph replays, medians, the read kernel's plain read), `power`
(NVML's clock limits and board power around a timing), `peers` (the decode's: torch SDPA and
flashinfer), `prefill_peers` (the prefill's: flashinfer's BF16 prefill, alone and after a dequantize),
`rows` (the result rows and the JSON document), `report` (text, plot, the run's context), `run`
(the run tied together); `kernels` and `nvml` load the harness's own kernels and NVML.

What is measured
----------------
* **read bandwidth**: a kernel that reads ``Config.ceiling_bytes`` (2 GiB) with 16-byte loads,
  4 in flight per thread, 8 CTAs of 256 threads per SM (``cuda/bench``); the median of 30
  event-timed reads after 3 warm-up reads. It is the ceiling that every "% of ceiling" and every
  floor refers to: what plain streaming reads reach on this device, somewhat below the
  datasheet's HBM bandwidth. A decode mostly reads, so this is the bound it is held to.
* **copy bandwidth (read+write)**: one ``cuMemcpyDtoDAsync`` of ``Config.ceiling_bytes``, counting
  the bytes read plus the bytes written, timed the same way; reported beside the ceiling.
* **launch floor**: a CUDA graph holding one empty kernel (one warp, ``cuda/bench``), timed exactly
  like the library's launches: the smallest time this method reports for any launch.
* **decode / write**: one library launch per CUDA graph (one graph per input set), replayed.
* **plain read** (``plain_read_us``, decode rows and their peers): the read kernel of the ceiling
  over exactly the row's bytes, one launch per CUDA graph replay, rotating as many buffers as the
  row has input sets. It is what one launch that must read those bytes takes at best on this
  device, its launch, ramp-up and tail included, where the floor counts the bytes alone: a short
  row's plain read lies well above its floor (on an H200, 48 MB take 14.9 µs against 10.7 µs).
* **in-graph time** (``in_graph_us``, also of the launch floor): one CUDA graph of 32 launches
  back to back, rotating the input sets, replayed; its time divided by 32. That is what a launch
  costs inside an engine's captured decode step: a graph node, without a graph launch of its own.
* **prefill** (``--op prefill``, only when named: its long rows are no part of ``all``): one
  ``paged_prefill_attn`` per CUDA graph, the chunk of ``q_len`` (``--chunks``) query tokens per
  sequence the last positions of its context, which the pools hold before the timing; timed as the
  decode (and its in-graph time), with ``flops`` and ``tflops`` (4 · q_heads · head_dim per
  (token, attended position), the causal triangle exact). Its peers (`prefill_peers`): flashinfer's
  causal paged prefill over a BF16 cache of as many tokens, alone and after the library's dequantize
  of the context into it (in one graph), each the faster of the FA2 and FA3 backends
  (``vs_bf16_prefill``, ``vs_round_trip``: their time over the row's).
* **peers** (decode, shared by the rows of one shape whatever the V bits): torch's
  ``scaled_dot_product_attention`` over contiguous BF16 K/V (``bf16_sdpa``); the straightforward
  FP8 cache decode in torch, contiguous FP8 E4M3 K/V cast to BF16 in each decode and then the same
  SDPA (``fp8_sdpa``); and flashinfer's paged decode over an FP8 E4M3 cache (``fp8_flashinfer``).
  Each is "absent" when its modules are not importable; all decode one query token per sequence,
  so they do not run with ``q_len > 1`` (``--q-len``, the multi-token decode through
  ``query_start``).

How a time is taken
-------------------
Sample ``i`` is: an event, the launch for input set ``i mod sets``, an event, all on one stream;
the reported time is the median over samples. The samples are queued behind a gate (the stream
waits with ``cuStreamWaitValue32`` on a device word that a second stream writes once a chunk of
samples is queued), so the GPU runs them back to back and the host's cost of launching is not
timed (on an H200 the launch floor reads 2.4 µs so, 4.3 µs without the gate). Where the driver
refuses stream memory operations, or when asked (``Device(timing_gate=False)``,
``--no-timing-gate``: under compute-sanitizer's initcheck, gated runs never finished), the gate is
off (``timing_gate`` in the device dict) and short launches then include some host time. Input
sets rotate so that consecutive launches read different memory; a row whose sets together fit in
L2 is marked "L2" and its bandwidth may exceed the ceiling (the H200's L2 holds 60 MB: the short
shapes fit). Each set's own median is kept too (``set_medians_us``): where they lie more than 5 %
apart the row is marked "sets N %", since its median then is one set's time rather than the
others' and moves between runs with the sets (memory placement, say); where a row moves between
runs although its sets agree, the cause lies elsewhere. One such cause is the GPU's power limit
(or its temperature) holding its clocks down, which slows an issue-bound kernel: NVML's counters
of that time (`nvml`) are read around each row's timing and each peer's, and kept
as ``clock_limited`` (the share of the measuring time per limit); a row where a limit held the
clocks for more than 1 % of it is marked "power cap N %" or "thermal N %". Where NVML is not
available the report says so and nothing is marked.

Power (``power_window_s``, ``--power-window``): after a row's timing its launches run back to back
(in graphs of `timing.GRAPH_CHAIN`; a peer's, one per graph replay) for about that many seconds more, and
NVML's energy counter gives the board's mean power over them, from one of its steps (about every
100 ms on an H200) to another: ``power_w``, and ``energy_mj`` per launch at the row's time. It is
the whole board's power, idle share included; short launches whose host cost exceeds their GPU
time leave the GPU gaps and read low.

Units
-----
Sizes are bytes unless named ``*_elems``; times are microseconds (µs); bandwidths are GB/s with
1 GB = 1e9 bytes. "Bytes" of a launch are the bytes the format obliges it to move
(`config.launch_bytes`), not what a profiler would count; the floor is those bytes over the ceiling.
"""
