"""CPU tests of checked mode's Python side: IndexErrorFlags and CacheIndexError against the header,
and fp8kturbov.checked (ErrorWord, check_errors) against the fake driver of conftest's ``driver``
fixture (which contexts, streams and memory operations they use). What the kernels report is
tested on a GPU (test_checked_mode*.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import fp8kturbov
from fp8kturbov import CacheIndexError, ErrorWord, IndexErrorFlags, _device, check_errors, checked

HEADER = Path(__file__).resolve().parents[1] / "cuda" / "include" / "fp8kturbov.h"


def header_index_errors() -> dict[str, int]:
    """``fp8kturbov_index_error_t`` of the header: {name without prefix: value}."""
    if not HEADER.exists():
        pytest.skip(f"{HEADER} not found (tests run from a checkout)")
    code = re.sub(r"/\*.*?\*/", " ", HEADER.read_text(), flags=re.S)
    body = re.search(r"typedef enum fp8kturbov_index_error \{(.*?)\}", code, re.S).group(1)
    return {name: int(value) for name, value in re.findall(r"FP8KTURBOV_INDEX_ERROR_(\w+)\s*=\s*(\d+)", body)}


# What the header says the kernels do about each flag: words its message must contain.
CONSEQUENCES = {"SLOT": ("slot", ">= num_blocks", "skipped", "zeros"),
                "BLOCK_TABLE": ("block-table entry", "num_blocks", "left out"),
                "SEQ_LEN": ("seq_len", "clamped"),
                "QUERY_START": ("query_start", "max_q_len", "num_query_rows", "skipped", "causal")}


# ---- The flags and the exception ---------------------------------------------------------------------
def test_index_error_flags_mirror_the_header():
    found = header_index_errors()
    assert found, "no FP8KTURBOV_INDEX_ERROR_ values parsed from the header"
    assert {flag.name: flag.value for flag in IndexErrorFlags} == found
    assert set(CONSEQUENCES) == set(found)  # a new flag needs its entry here


@pytest.mark.parametrize("value", range(1, 16))
def test_cache_index_error_names_each_set_flag_and_its_consequence(value):
    error = CacheIndexError(value)
    assert isinstance(error, RuntimeError)
    assert type(error.flags) is IndexErrorFlags and error.flags == value
    message = str(error)
    assert f"error flags {value:#x}" in message
    for name, words in CONSEQUENCES.items():
        is_set = bool(IndexErrorFlags[name] & value)
        assert (name in message) == is_set, (name, message)
        if is_set:
            assert all(word in message for word in words), (words, message)
    assert "unknown" not in message


def test_cache_index_error_shows_unknown_bits():
    message = str(CacheIndexError(0x31))
    assert "SLOT" in message and "unknown bits 0x30" in message
    assert "BLOCK_TABLE" not in message and "SEQ_LEN" not in message and "QUERY_START" not in message


def test_checked_mode_names_are_exported():
    for name, module in [("IndexErrorFlags", fp8kturbov._errors), ("CacheIndexError", fp8kturbov._errors),
                         ("ErrorWord", checked), ("check_errors", checked)]:
        assert name in fp8kturbov.__all__ and getattr(fp8kturbov, name) is getattr(module, name)


# ---- ErrorWord ------------------------------------------------------------------------------------------
class ProtocolStream:
    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, 0x7890)


def test_error_word_is_zeroed_at_creation_in_its_device_context(driver):
    word = ErrorWord(device=1)
    assert driver.live == {word.ptr: (4, 1)} and word.device == 1 and not word.closed
    assert driver.word(word.ptr) == 0  # cuMemAlloc left garbage there
    # Zeroed on the legacy default stream, then waited for: every stream finds 0.
    assert driver.log == [("memset", 0, 1), ("sync", 0, 1)]
    assert driver.stack == [] and driver.references[1] == 1  # held while the word lives


def test_read_waits_for_the_stream_and_leaves_the_word(driver):
    word = ErrorWord(device=1)
    driver.log.clear()
    assert word.read(0x50) == 0
    driver.set_word(word.ptr, IndexErrorFlags.BLOCK_TABLE | IndexErrorFlags.SEQ_LEN)
    flags = word.read(ProtocolStream())
    assert type(flags) is IndexErrorFlags and flags == IndexErrorFlags.BLOCK_TABLE | IndexErrorFlags.SEQ_LEN
    assert driver.word(word.ptr) == 6
    # The copy is queued on the stream, after the launches being checked, and then waited for.
    assert driver.log == [("copy", 0x50, 1), ("sync", 0x50, 1), ("copy", 0x7890, 1), ("sync", 0x7890, 1)]


def test_check_raises_once_and_zeroes_in_stream_order(driver):
    # Closed here, by this test's fake driver: the exception info below keeps the word in a
    # reference cycle, which a later test's garbage collection would otherwise free.
    with ErrorWord() as word:
        driver.log.clear()
        word.check(0x70)
        assert driver.log == [("copy", 0x70, 0), ("sync", 0x70, 0)]  # nothing set: nothing zeroed
        driver.set_word(word.ptr, IndexErrorFlags.SLOT)
        driver.set_word(word.ptr, IndexErrorFlags.SEQ_LEN)
        with pytest.raises(CacheIndexError) as info:
            word.check(0x70)
        assert info.value.flags == IndexErrorFlags.SLOT | IndexErrorFlags.SEQ_LEN
        assert driver.word(word.ptr) == 0 and driver.log[-1] == ("memset", 0x70, 0)
        word.check(0x70)  # reported once


def test_reset_is_stream_ordered_without_a_wait(driver):
    word = ErrorWord()
    driver.set_word(word.ptr, IndexErrorFlags.SLOT)
    driver.log.clear()
    word.reset(0x80)
    assert driver.word(word.ptr) == 0 and driver.log == [("memset", 0x80, 0)]


@pytest.mark.parametrize("stream, handle", [(None, 0), (0x1230, 0x1230), (ProtocolStream(), 0x7890)],
                         ids=["none", "int", "cuda_stream_protocol"])
def test_stream_kinds(driver, stream, handle):
    word = ErrorWord()
    driver.log.clear()
    word.check(stream)
    assert driver.log == [("copy", handle, 0), ("sync", handle, 0)]


def test_stream_of_the_wrong_type_is_refused_before_the_driver(driver):
    word = ErrorWord()
    driver.log.clear()
    for call in (word.read, word.check, word.reset):
        with pytest.raises(TypeError, match="^stream: "):
            call(1.5)
    assert driver.log == []


def test_close_frees_the_word(driver):
    with ErrorWord(device=1) as word:
        pass
    assert word.closed and word.ptr == 0
    assert driver.live == {} and driver.references[1] == 0
    word.close()  # idempotent
    driver.log.clear()
    for call in (word.read, word.check, word.reset):
        with pytest.raises(ValueError, match="closed"):
            call()
    assert driver.log == []


def test_error_word_needs_a_driver(monkeypatch):
    monkeypatch.setattr(_device, "driver", lambda: None)
    with pytest.raises(fp8kturbov.CudaError, match="no usable CUDA driver"):
        ErrorWord()
    with pytest.raises(fp8kturbov.CudaError, match="no usable CUDA driver"):
        check_errors(0x1000)


# ---- check_errors: a word the caller owns, in the current context -------------------------------------
@pytest.fixture
def own_word(driver) -> int:
    """A zeroed word allocated by the caller with device 1's context current."""
    driver.stack.append(1)
    _, ptr = driver.cuMemAlloc(4)
    driver.memory[ptr][:] = bytes(4)
    return ptr


def test_check_errors_reads_a_raw_word_in_the_current_context(driver, own_word):
    check_errors(own_word, 0x90)
    driver.set_word(own_word, IndexErrorFlags.BLOCK_TABLE)
    with pytest.raises(CacheIndexError) as info:
        check_errors(own_word, stream=0x90)
    assert info.value.flags == IndexErrorFlags.BLOCK_TABLE and driver.word(own_word) == 0
    assert driver.log == [("copy", 0x90, 1), ("sync", 0x90, 1),
                          ("copy", 0x90, 1), ("sync", 0x90, 1), ("memset", 0x90, 1)]
    assert driver.stack == [1] and driver.references == {0: 0, 1: 0}  # no context pushed


def test_check_errors_uses_no_context_of_its_own(driver, own_word):
    driver.stack.clear()
    with pytest.raises(fp8kturbov.CudaError, match="cuMemcpyDtoHAsync"):
        check_errors(own_word)


@pytest.mark.parametrize("address, error, text", [
    (0, fp8kturbov.NullPointerError, "error_flags is NULL"),
    (0x1002, fp8kturbov.MisalignedError, "error_flags = 0x1002 is not 4-byte aligned"),
    (-4, fp8kturbov.InvalidValueError, "error_flags = -4"),
    (2**64, fp8kturbov.InvalidValueError, f"error_flags = {2**64}"),
], ids=["null", "misaligned", "negative", "too_large"])
def test_check_errors_refuses_a_bad_address_before_the_driver(driver, address, error, text):
    with pytest.raises(error, match=re.escape(text)):
        check_errors(address)
    assert driver.log == []
