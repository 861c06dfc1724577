"""Hostile arguments to the NumPy reference (``fp8kturbov.reference``), drawn by hypothesis from the
argument contract: each scalar from outside its valid range (zero where it must be positive, negative,
NaN, ±inf, beyond its C type or float32, not a number, not an integer), each array with a wrong
dtype, too few entries or an entry out of range. The reference must refuse every one with a
ValueError (TypeError for an array of the wrong kind) whose message names the argument.

For the rules that the C library checks too, the same scalar goes to the library through
`fp8kturbov.ops` with zero work and NULL pointers (num_tokens = 0 / num_seqs = 0: validation only,
nothing launches, as in test_abi.py): it must refuse it naming the same argument, and where both
apply the same rule, in the same words (the reference names ``bits``, ``encoder`` and ``rotation``
what the C ABI calls ``v_bits``, ``v_encoder`` and ``v_rotation``).

Where the library computes a result for an odd input (a seq_len outside the block table, entries of
positions no query attends, NaN data), the reference must compute the documented one.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fp8kturbov  # noqa: E402
from fp8kturbov import ops  # noqa: E402
from fp8kturbov import reference as R  # noqa: E402

U32_MAX, U64_MAX = 2**32 - 1, 2**64 - 1
I32_MIN, I32_MAX = -2**31, 2**31 - 1
FLT_MAX = float(np.finfo(np.float32).max)
HOSTILE = settings(max_examples=20, deadline=None, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# ---- One small valid call of each entry; sizes from FORMAT.md §2/§3 ---------------------------------
H, D, B, BITS, Q_HEADS, NUM_PAGES = 2, 64, 16, 3, 4, 3
N = H * D
K_PAGE, V_DATA = B * N, B * N * BITS // 8
V_PAGE = V_DATA + B * N // 16
LAYOUT = dict(num_kv_heads=H, head_dim=D, block_size=B, k_block_stride_bytes=K_PAGE,
              v_block_stride_bytes=V_PAGE, v_data_section_bytes=V_DATA, bits=BITS)
K_SCALE = 0.05


@lru_cache(maxsize=None)
def written_pools() -> tuple[np.ndarray, np.ndarray]:
    """Read-only pools of NUM_PAGES pages, every slot written by the reference (bf16 N(0, 1) rows)."""
    rng = np.random.default_rng(7)
    slots = NUM_PAGES * B
    k_pool, v_pool = np.zeros(NUM_PAGES * K_PAGE, np.uint8), np.zeros(NUM_PAGES * V_PAGE, np.uint8)
    key, value = (rng.standard_normal((slots, N)).astype(ml_dtypes.bfloat16) for _ in range(2))
    R.write_cache(key, value, k_pool, v_pool, np.arange(slots), slots, key_stride=N, value_stride=N,
                  k_scale=K_SCALE, **LAYOUT)
    k_pool.flags.writeable = v_pool.flags.writeable = False
    return k_pool, v_pool


def valid_args(function: str) -> dict[str, Any]:
    """Keyword arguments of a valid call of ``reference.<function>``."""
    k_pool, v_pool = written_pools()
    slots = np.array([0, -1, 2 * B + 5])  # a padding slot in the middle
    if function == "write_cache":
        rows = np.linspace(-3, 3, 3 * N, dtype=np.float32).reshape(3, N)
        return dict(key=rows, value=rows[::-1].copy(), k_cache=k_pool.copy(), v_cache=v_pool.copy(),
                    slot_mapping=slots, num_tokens=3, key_stride=N, value_stride=N, k_scale=K_SCALE,
                    encoder="matched_norm", rotation=False, **LAYOUT)
    if function == "dequantize_cache":
        return dict(k_cache=k_pool, v_cache=v_pool, slot_mapping=slots, num_tokens=3, k_scale=K_SCALE, **LAYOUT)
    if function == "paged_decode":
        # Sequence 1 holds 5 positions: its second table entry is never attended, so -1 is allowed.
        return dict(q=np.full((2, Q_HEADS * D), 0.125, np.float32), k_cache=k_pool, v_cache=v_pool,
                    block_tables=np.array([[0, 1], [2, -1]], np.int32), seq_lens=np.array([20, 5], np.int32),
                    max_blocks_per_seq=2, num_seqs=2, num_q_heads=Q_HEADS, inv_sqrt_d=0.125, k_scale=K_SCALE,
                    q_stride=Q_HEADS * D, sliding_window=0, sparse_v_threshold=0.0, soft_cap=0.0,
                    sinks=np.zeros(Q_HEADS), query_start=np.array([0, 1, 2], np.int32), rotation=False,
                    **LAYOUT)
    shape = dict(block_size=B, num_kv_heads=H, head_dim=D)
    return {"encode_k": dict(x=np.linspace(-1, 1, 32, dtype=np.float32), k_scale=K_SCALE),
            "decode_k": dict(b=np.arange(256, dtype=np.uint8), k_scale=K_SCALE),
            "encode_v": dict(x=np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), bits=BITS,
                             encoder="matched_norm"),
            "decode_v": dict(data=np.zeros((2, 12), np.uint8), scales=np.zeros((2, 2), np.uint8), bits=BITS),
            "pack_codes": dict(codes=np.zeros((2, 32), np.uint8), bits=BITS),
            "unpack_codes": dict(data=np.zeros((2, 12), np.uint8), bits=BITS),
            "k_page_bytes": shape, "v_scale_section_bytes": shape,
            "v_data_section_bytes": dict(shape, bits=BITS), "v_page_bytes": dict(shape, bits=BITS),
            "v_group_bytes": dict(bits=BITS)}[function]


def names(message: str, argument: str) -> bool:
    """Whether ``message`` names ``argument`` (as a whole word: ``bits`` is not named by ``v_bits``)."""
    return re.search(rf"(?<!\w){re.escape(argument)}(?!\w)", message) is not None


def reference_refusal(function: str, args: dict[str, Any], argument: str,
                      expected: type[Exception] | tuple[type[Exception], ...] = (ValueError, TypeError)) -> str:
    """The message of the reference's refusal of ``args``, which must name ``argument``."""
    with pytest.raises(expected) as info:
        getattr(R, function)(**args)
    message = getattr(info.value, "message", str(info.value))  # the library's exceptions carry it bare
    assert names(message, argument), message
    return message


# ---- The library's twin of a reference call: zero work, NULL pointers ------------------------------
C_NAMES = {"bits": "v_bits", "encoder": "v_encoder", "rotation": "v_rotation"}
C_ENTRIES: dict[str, tuple[Callable[..., None], int, str]] = {  # entry, its pointers, its work count
    "write_cache": (ops.reshape_and_cache, 5, "num_tokens"),
    "dequantize_cache": (ops.dequantize, 5, "num_tokens"),
    "paged_decode": (ops.paged_decode_attn, 6, "num_seqs"),
}
C_SCALARS = {
    "write_cache": ["num_tokens", "num_kv_heads", "head_dim", "block_size", "key_stride", "value_stride",
                    "k_scale", "bits", "k_block_stride_bytes", "v_block_stride_bytes", "v_data_section_bytes"],
    "dequantize_cache": ["num_tokens", "num_kv_heads", "head_dim", "block_size", "k_scale", "bits",
                         "k_block_stride_bytes", "v_block_stride_bytes", "v_data_section_bytes"],
    "paged_decode": ["max_blocks_per_seq", "num_seqs", "num_q_heads", "num_kv_heads", "head_dim", "block_size",
                     "inv_sqrt_d", "k_scale", "q_stride", "bits", "v_block_stride_bytes", "v_data_section_bytes",
                     "k_block_stride_bytes", "sliding_window", "sparse_v_threshold", "soft_cap"],
}


def library_refusal(function: str, args: dict[str, Any], argument: str, **c_only: Any) -> str:
    """The library's message (without its ``fp8kturbov_<entry>: `` prefix) refusing the scalars of a
    reference call, with no work unless ``argument`` is the work count; it must name ``argument``."""
    entry, num_pointers, work = C_ENTRIES[function]
    scalars = {C_NAMES.get(name, name): args[name] for name in C_SCALARS[function]}
    if argument != work:
        scalars[work] = 0
    if function == "dequantize_cache":  # the rows it writes; the reference returns dense ones
        scalars.update(key_stride=N, value_stride=N)
    with pytest.raises(fp8kturbov.Fp8kturbovError) as info:
        entry(*[0] * num_pointers, **scalars, **c_only)
    assert isinstance(info.value, ValueError), info.value  # INVALID_VALUE (the package's or the C check's)
    message = re.sub(r"^fp8kturbov_\w+: ", "", info.value.message)
    assert names(message, C_NAMES.get(argument, argument)), message
    return message


# ---- Hostile scalars ---------------------------------------------------------------------------------
NOT_INTEGERS = st.one_of(st.floats(), st.booleans(), st.none(), st.text(max_size=3),
                         st.sampled_from([np.float64(16.0), np.bool_(True), 16 + 0j]))
NOT_NUMBERS = st.one_of(st.booleans(), st.none(), st.text(max_size=3), st.sampled_from([np.bool_(False), 1j, b"1"]),
                        st.complex_numbers(max_magnitude=10, allow_nan=False))
NAN = st.sampled_from([math.nan, -math.nan])
INFINITE = st.sampled_from([math.inf, -math.inf])
BEYOND_FLOAT32 = st.floats(min_value=FLT_MAX * (1 + 2**-20), allow_infinity=False).flatmap(
    lambda x: st.sampled_from([x, -x]))
ZERO_IN_FLOAT32 = st.floats(min_value=5e-324, max_value=7e-46).flatmap(lambda x: st.sampled_from([x, -x]))
NOT_A_FLOAT32 = st.one_of(NOT_NUMBERS, BEYOND_FLOAT32, ZERO_IN_FLOAT32)


def bad_integers(limit: int = U32_MAX) -> st.SearchStrategy:
    """Not an integer of the C type (uint32_t, or uint64_t with U64_MAX): other types, < 0, > limit."""
    return st.one_of(NOT_INTEGERS, st.integers(max_value=-1), st.integers(min_value=limit + 1),
                     st.integers(min_value=-100, max_value=-1).map(np.int64))


def zero_or(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.just(0), strategy)


NOT_FINITE_AND_NON_NEGATIVE = st.one_of(NOT_A_FLOAT32, NAN, INFINITE, st.floats(max_value=-1e-300))


@dataclass(frozen=True)
class Rule:
    """Values of ``argument`` that every function of ``functions`` must refuse."""

    argument: str
    functions: tuple[str, ...]
    values: st.SearchStrategy
    same_words: bool = True  # the library refuses them with the reference's rule and message

    def cases(self) -> list[Any]:
        return [pytest.param(function, self, id=f"{function}-{self.argument}") for function in self.functions]


CACHE = ("write_cache", "dequantize_cache", "paged_decode")
SHAPE = ("k_page_bytes", "v_data_section_bytes", "v_scale_section_bytes", "v_page_bytes")
BITS_FUNCTIONS = ("encode_v", "decode_v", "pack_codes", "unpack_codes", "v_data_section_bytes", "v_page_bytes",
                  "v_group_bytes")
RULES = [
    Rule("num_kv_heads", CACHE + SHAPE, zero_or(bad_integers())),
    Rule("head_dim", CACHE + SHAPE, zero_or(st.one_of(bad_integers(),
                                                      st.integers(1, U32_MAX).filter(lambda d: d % 16 != 0)))),
    Rule("block_size", CACHE + SHAPE, zero_or(bad_integers())),
    Rule("bits", CACHE + BITS_FUNCTIONS, st.one_of(bad_integers(),
                                                   st.integers(0, U32_MAX).filter(lambda b: b not in (2, 3, 4)))),
    Rule("k_block_stride_bytes", ("write_cache", "dequantize_cache"),
         st.one_of(bad_integers(U64_MAX), st.integers(0, K_PAGE - 1))),
    Rule("k_block_stride_bytes", ("paged_decode",),  # None and 0: packed
         st.one_of(bad_integers(U64_MAX), st.integers(1, K_PAGE - 1)).filter(lambda v: v is not None)),
    Rule("v_data_section_bytes", CACHE, st.one_of(bad_integers(U64_MAX), st.integers(0, V_DATA - 1))),
    Rule("v_block_stride_bytes", CACHE, st.one_of(bad_integers(U64_MAX), st.integers(0, V_PAGE - 1))),
    Rule("k_scale", CACHE + ("encode_k", "decode_k"),
         st.one_of(NOT_A_FLOAT32, NAN, INFINITE, st.floats(max_value=0.0))),
    # The write multiplies by 1/k_scale, inf in float32 below ~2^-128 (FORMAT.md §2) ...
    Rule("k_scale", ("write_cache",), st.floats(min_value=1.5e-45, max_value=2.5e-39)),
    # ... and the decode by inv_sqrt_d · k_scale, 0 in float32 for these with inv_sqrt_d = 0.125.
    Rule("k_scale", ("paged_decode",), st.floats(min_value=1.5e-45, max_value=4.9e-45)),
    Rule("num_tokens", ("write_cache", "dequantize_cache"), bad_integers()),
    *[Rule(name, ("write_cache",), st.one_of(bad_integers(), st.integers(0, N - 1)))
      for name in ("key_stride", "value_stride")],
    Rule("num_seqs", ("paged_decode",), bad_integers()),
    # More sequences than one grid holds in the library; fewer table rows than that in the reference.
    Rule("num_seqs", ("paged_decode",), st.integers(2**30, U32_MAX), same_words=False),
    Rule("num_q_heads", ("paged_decode",), zero_or(st.one_of(
        bad_integers(), st.integers(1, U32_MAX).filter(lambda h: h % H != 0),
        st.integers(65536 // H, U32_MAX // H).map(lambda g: g * H)))),
    Rule("max_blocks_per_seq", ("paged_decode",), zero_or(st.one_of(bad_integers(),
                                                                    st.integers(I32_MAX // B + 1, U32_MAX)))),
    Rule("q_stride", ("paged_decode",), st.one_of(bad_integers(), st.integers(0, Q_HEADS * D - 1))),
    Rule("sliding_window", ("paged_decode",), bad_integers()),
    Rule("inv_sqrt_d", ("paged_decode",), st.one_of(NOT_A_FLOAT32, NAN, INFINITE)),
    # (None is the reference's "not a number" but the package's "the library's default".)
    Rule("sparse_v_threshold", ("paged_decode",), NOT_FINITE_AND_NON_NEGATIVE.filter(lambda v: v is not None)),
    Rule("soft_cap", ("paged_decode",), NOT_FINITE_AND_NON_NEGATIVE),
]
SCALAR_CASES = [case for rule in RULES for case in rule.cases()]


def in_library_words(reference_message: str, argument: str) -> str:
    """The reference's message with the library's name for the argument."""
    if reference_message.startswith(argument):
        reference_message = C_NAMES.get(argument, argument) + reference_message[len(argument):]
    return reference_message


@pytest.mark.parametrize("function, rule", SCALAR_CASES)
@HOSTILE
@given(data=st.data())
def test_hostile_scalar_is_refused_naming_it(function, rule, data):
    args = {**valid_args(function), rule.argument: data.draw(rule.values, label=rule.argument)}
    message = reference_refusal(function, args, rule.argument)
    if function in C_ENTRIES:
        library_message = library_refusal(function, args, rule.argument).replace("-nan", "nan")  # printf's
        if rule.same_words:
            assert library_message == in_library_words(message, rule.argument)


@pytest.mark.parametrize("function", ["write_cache", "paged_decode"])
def test_rotation_of_a_head_dim_without_signs_is_refused_naming_head_dim(function):
    """FORMAT.md §6 defines the rotation's signs for head_dim 128, 256 and 512 only (here 64)."""
    args = {**valid_args(function), "rotation": True}
    reference_refusal(function, args, "head_dim", ValueError)
    library_refusal(function, args, "head_dim", v_rotation=1)


@pytest.mark.parametrize("function", ["write_cache", "paged_decode"])
@pytest.mark.parametrize("rotation, v_rotation", [(1, 2), (np.int64(0), U32_MAX), ("none", 7)])
def test_rotation_that_is_not_a_bool_is_refused(function, rotation, v_rotation):
    reference_refusal(function, {**valid_args(function), "rotation": rotation}, "rotation", TypeError)
    library_refusal(function, valid_args(function), "rotation", v_rotation=v_rotation)


@pytest.mark.parametrize("function", ["write_cache", "encode_v"])
@pytest.mark.parametrize("encoder, v_encoder", [("MSE", 3), ("", 3), (1, U32_MAX), (None, 4)])
def test_unknown_encoder_is_refused(function, encoder, v_encoder):
    reference_refusal(function, {**valid_args(function), "encoder": encoder}, "encoder", ValueError)
    if function in C_ENTRIES:
        library_refusal(function, valid_args(function), "encoder", v_encoder=v_encoder)


def test_scalar_rules_pass_the_valid_calls():
    """Each hostile case above differs from a valid call in one argument only."""
    for function in {case.values[0] for case in SCALAR_CASES}:
        getattr(R, function)(**valid_args(function))


# ---- Hostile arrays (the reference only: the library does not read device data on the host) --------
INTEGER_DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64, np.bool_]
NOT_INTEGER_DTYPES = [np.float16, np.float32, np.float64, ml_dtypes.bfloat16, np.complex64, np.bool_]
Make = Callable[[Callable[[st.SearchStrategy], Any], Any], Any]  # (draw, the valid value) -> the hostile one


def as_dtype(dtypes: list) -> Make:
    return lambda draw, valid: np.asarray(valid).astype(draw(st.sampled_from(dtypes)))


def first_entry(values: st.SearchStrategy, dtype: type = np.int64) -> Make:
    """The valid array with its first entry (one that is read) replaced, in ``dtype``."""
    def make(draw, valid):
        array = np.array(valid).astype(dtype)
        array.flat[0] = draw(values)
        return array
    return make


def truncated(size: st.SearchStrategy) -> Make:
    return lambda draw, valid: np.asarray(valid).reshape(-1)[:draw(size)]


def resized(sizes: st.SearchStrategy) -> Make:
    return lambda draw, valid: np.resize(np.asarray(valid).reshape(-1), draw(sizes))


def of_kind(values: st.SearchStrategy) -> Make:
    return lambda draw, valid: draw(values)


@dataclass(frozen=True)
class ArrayRule:
    argument: str
    functions: tuple[str, ...]
    make: Make
    error: type[Exception]

    def cases(self) -> list[Any]:
        return [pytest.param(function, self, id=f"{function}-{self.argument}-{self.error.__name__}")
                for function in self.functions]


OUTSIDE_INT32 = st.one_of(st.integers(max_value=I32_MIN - 1, min_value=-2**63),
                          st.integers(min_value=I32_MAX + 1, max_value=2**63 - 1))
NOT_A_BYTE = st.one_of(st.integers(min_value=-2**63, max_value=-1), st.integers(min_value=256, max_value=2**63 - 1))
NOT_A_POOL = st.one_of(
    st.sampled_from([np.int8, np.uint16, np.float32, np.int64]).map(lambda t: np.zeros(NUM_PAGES * V_PAGE, t)),
    st.just(np.zeros((NUM_PAGES, V_PAGE), np.uint8)), st.just([0] * 64), st.none(), st.just(b"\0" * 64))
POOL_FUNCTIONS = ("write_cache", "dequantize_cache", "paged_decode")
SLOT_FUNCTIONS = ("write_cache", "dequantize_cache")
BYTE_ARRAYS = [("decode_k", "b"), ("decode_v", "data"), ("decode_v", "scales"), ("unpack_codes", "data")]
ARRAY_RULES = [
    *[ArrayRule(name, (function,), as_dtype(INTEGER_DTYPES), TypeError)
      for function, name in [("write_cache", "key"), ("write_cache", "value"), ("paged_decode", "q"),
                             ("paged_decode", "sinks"), ("encode_k", "x"), ("encode_v", "x")]],
    *[ArrayRule(name, (function,), as_dtype(NOT_INTEGER_DTYPES), TypeError)
      for function, name in [*[(f, "slot_mapping") for f in SLOT_FUNCTIONS], ("paged_decode", "block_tables"),
                             ("paged_decode", "seq_lens"), ("paged_decode", "query_start"),
                             ("pack_codes", "codes"), *BYTE_ARRAYS]],
    *[ArrayRule(name, POOL_FUNCTIONS, of_kind(NOT_A_POOL), TypeError) for name in ("k_cache", "v_cache")],
    # Entries out of range: no wrap, no truncation, no NumPy negative index.
    ArrayRule("slot_mapping", SLOT_FUNCTIONS, first_entry(st.integers(NUM_PAGES * B, 2**63 - 1)), ValueError),
    ArrayRule("slot_mapping", SLOT_FUNCTIONS, first_entry(st.integers(2**63, U64_MAX), np.uint64), ValueError),
    ArrayRule("block_tables", ("paged_decode",), first_entry(st.one_of(
        st.integers(I32_MIN, -1), st.integers(NUM_PAGES, I32_MAX), OUTSIDE_INT32)), ValueError),
    *[ArrayRule(name, ("paged_decode",), first_entry(OUTSIDE_INT32), ValueError)
      for name in ("seq_lens", "query_start")],
    *[ArrayRule(name, (function,), first_entry(NOT_A_BYTE), ValueError) for function, name in BYTE_ARRAYS],
    ArrayRule("codes", ("pack_codes",), first_entry(st.one_of(st.integers(2**BITS, 2**63 - 1),
                                                              st.integers(-2**63, -1))), ValueError),
    # Too few entries, or a shape that does not fit the other arguments.
    *[ArrayRule(name, ("write_cache",), truncated(st.integers(0, 3 * N - 1)), ValueError) for name in ("key", "value")],
    ArrayRule("q", ("paged_decode",), truncated(st.integers(0, 2 * Q_HEADS * D - 1)), ValueError),
    ArrayRule("slot_mapping", SLOT_FUNCTIONS, truncated(st.integers(0, 2)), ValueError),
    ArrayRule("seq_lens", ("paged_decode",), truncated(st.integers(0, 1)), ValueError),
    ArrayRule("block_tables", ("paged_decode",), resized(st.integers(0, 12).filter(lambda n: n != 4)), ValueError),
    ArrayRule("sinks", ("paged_decode",), resized(st.integers(0, 12).filter(lambda n: n != Q_HEADS)), ValueError),
    ArrayRule("query_start", ("paged_decode",), resized(st.integers(0, 6).filter(lambda n: n != 3)), ValueError),
    ArrayRule("scales", ("decode_v",), resized(st.integers(0, 12).filter(lambda n: n != 4)), ValueError),
    *[ArrayRule(name, (function,), resized(st.integers(0, 64).filter(lambda n, m=multiple: n % m != 0)), ValueError)
      for function, name, multiple in [("encode_v", "x", 16), ("pack_codes", "codes", 16),
                                       ("unpack_codes", "data", 2 * BITS), ("decode_v", "data", 2 * BITS)]],
]
ARRAY_CASES = [case for rule in ARRAY_RULES for case in rule.cases()]


@pytest.mark.parametrize("function, rule", ARRAY_CASES)
@HOSTILE
@given(data=st.data())
def test_hostile_array_is_refused_naming_it(function, rule, data):
    args = valid_args(function)
    args[rule.argument] = rule.make(data.draw, args[rule.argument])
    reference_refusal(function, args, rule.argument, rule.error)


def test_array_rules_pass_the_valid_calls():
    for function in {case.values[0] for case in ARRAY_CASES}:
        getattr(R, function)(**valid_args(function))


# ---- What the library computes, the reference computes -------------------------------------------------
def decode(**changes: Any) -> np.ndarray:
    return R.paged_decode(**{**valid_args("paged_decode"), "query_start": None, **changes})


@HOSTILE
@given(lengths=st.lists(st.integers(I32_MIN, I32_MAX), min_size=2, max_size=2))
def test_seq_len_outside_the_table_is_clamped_to_it(lengths):
    """The kernels clamp a seq_len to [0, max_blocks_per_seq · block_size] (checked mode reports it)."""
    tables = np.array([[0, 1], [2, 0]], np.int32)
    got = decode(seq_lens=np.array(lengths, np.int32), block_tables=tables)
    want = decode(seq_lens=np.clip(lengths, 0, 2 * B).astype(np.int32), block_tables=tables)
    np.testing.assert_array_equal(got, want)


@HOSTILE
@given(entries=st.lists(st.integers(I32_MIN, I32_MAX), min_size=4, max_size=4),
       window=st.sampled_from([0, 3, 9]), lengths=st.lists(st.integers(0, 2 * B), min_size=2, max_size=2))
def test_entries_of_positions_no_query_attends_are_not_read(entries, window, lengths):
    """Only the block-table entries of attended positions must be pages (as the library's checked mode
    checks them): the others, past seq_len or before the sliding window, may hold anything."""
    tables = np.array([[0, 1], [2, 0]], np.int32)
    hostile = tables.copy()
    for s, seq_len in enumerate(lengths):
        first = seq_len - window if 0 < window < seq_len else 0
        attended = range(first // B, -(-seq_len // B))
        for i in set(range(2)) - set(attended):
            hostile[s, i] = entries[2 * s + i]
    seq_lens = np.array(lengths, np.int32)
    np.testing.assert_array_equal(decode(block_tables=hostile, seq_lens=seq_lens, sliding_window=window),
                                  decode(block_tables=tables, seq_lens=seq_lens, sliding_window=window))


@HOSTILE
@given(row=st.lists(st.floats(width=32), min_size=N, max_size=N))
def test_any_float_data_is_written_as_the_format_says(row):
    """NaN, ±inf and huge keys are data, not errors (FORMAT.md §2: NaN → 0x7F, beyond ±448 saturated)."""
    args = valid_args("write_cache")
    args["key"] = np.array([row] * 3, np.float32)
    R.write_cache(**args)
    page, offset = divmod(int(args["slot_mapping"][0]), B)
    written = args["k_cache"][page * K_PAGE + offset * N:][:N]
    np.testing.assert_array_equal(written, R.encode_k(np.array(row, np.float32), K_SCALE))
    assert np.all(written[np.isnan(np.array(row, np.float32))] == 0x7F)
