"""Hostile array and stream arguments of the tensor API, on a machine without a GPU: every
``__cuda_array_interface__`` that breaks the interface's rules (version 3, read to the letter), a
DLPack capsule on another device than its producer claims, a required array given as None and a
``__cuda_stream__`` handle out of range are refused with an error naming the argument; the
interfaces that follow the rules are read as before."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8kturbov import _device, _interop
from fp8kturbov._errors import ArgumentError, InvalidValueError
from fp8kturbov.arrays import _Call

VALID = {"version": 3, "shape": (4, 256), "typestr": "<V2", "data": (0x10000, False), "strides": None,
         "stream": None}


class Exporter:
    def __init__(self, interface):
        self.__cuda_array_interface__ = interface


def describe(interface):
    return _interop.describe("key", Exporter(interface))


@pytest.mark.parametrize("interface", [
    VALID,
    {**VALID, "strides": (1024, 2)},
    {**VALID, "stream": 1},
    {**VALID, "stream": 2},
    {k: v for k, v in VALID.items() if k not in ("strides", "stream")},
    {**VALID, "version": 2, "stream": None},
    {**VALID, "shape": [4, 256], "data": [0x10000, True]},
    {**VALID, "shape": (0, 256), "data": (0, False)},
])
def test_interfaces_that_follow_the_rules_are_read(interface):
    array = describe(interface)
    assert (array.dtype, array.shape, array.ptr) == ("bfloat16", tuple(interface["shape"]), interface["data"][0])


#: Each key of the interface with values that break its rules.
HOSTILE_VALUES = {
    "version": st.one_of(st.none(), st.integers(4, 10**6), st.integers(-10**6, -1), st.text(max_size=3),
                         st.floats(), st.just(True)),
    "shape": st.one_of(st.none(), st.integers(), st.lists(st.integers(-10**6, -1), min_size=1, max_size=3).map(tuple),
                       st.lists(st.floats(), min_size=1, max_size=3).map(tuple), st.just(("4", "256"))),
    "typestr": st.one_of(st.none(), st.integers(), st.binary(max_size=4)),
    "data": st.one_of(st.none(), st.integers(), st.tuples(st.none(), st.booleans()),
                      st.tuples(st.integers(-2**70, -1), st.booleans()),
                      st.tuples(st.integers(2**64, 2**70), st.booleans()),
                      st.tuples(st.integers(0, 2**40), st.integers(2, 9)),
                      st.tuples(st.integers(0, 2**40)), st.tuples(st.integers(0, 2**40), st.booleans(), st.none())),
    "strides": st.one_of(st.integers(), st.tuples(st.integers()), st.tuples(st.integers(), st.integers(), st.integers()),
                         st.tuples(st.floats(), st.floats())),
    "stream": st.one_of(st.just(0), st.integers(-2**70, -1), st.integers(2**64, 2**70), st.text(max_size=3),
                        st.just(True)),
}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(HOSTILE_VALUES)).flatmap(lambda key: st.tuples(st.just(key), HOSTILE_VALUES[key])))
def test_interfaces_that_break_a_rule_are_refused_by_name(case):
    key, value = case
    with pytest.raises(ArgumentError) as refused:
        describe({**VALID, key: value})
    assert refused.value.argument == "key" and "__cuda_array_interface__" in str(refused.value)


@settings(max_examples=50, deadline=None)
@given(st.sets(st.sampled_from(["version", "shape", "typestr", "data"]), min_size=1))
def test_interfaces_missing_a_required_key_are_refused_by_name(missing):
    with pytest.raises(ArgumentError, match="key: __cuda_array_interface__ without"):
        describe({k: v for k, v in VALID.items() if k not in missing})


@pytest.mark.parametrize("interface", [[], "not a dict", 42, (1, 2)])
def test_an_interface_that_is_no_dict_is_refused(interface):
    with pytest.raises(ArgumentError, match="key: __cuda_array_interface__ of type"):
        describe(interface)


def test_an_interface_attribute_of_none_is_no_interface():
    with pytest.raises(TypeError, match="^key: Exporter is not an array"):
        describe(None)


def test_a_stream_before_version_3_is_refused():
    with pytest.raises(ArgumentError, match="stream in version 2"):
        describe({**VALID, "version": 2, "stream": 5})


class ClaimsCuda:
    """A producer whose ``__dlpack_device__`` says CUDA device 0 while its capsule is NumPy's (CPU)."""

    def __init__(self):
        self.array = np.zeros((4, 256), dtype=np.uint16)

    def __dlpack_device__(self):
        return 2, 0

    def __dlpack__(self, stream=None, **kwargs):
        return self.array.__dlpack__()


def test_a_dlpack_capsule_on_another_device_than_claimed_is_refused():
    with pytest.raises(ArgumentError, match=r"key: a DLPack capsule on kDLCPU device 0, expected the device its "
                                            r"__dlpack_device__ names \(kDLCUDA device 0\)"):
        _interop.from_dlpack("key", ClaimsCuda(), 1)


def test_a_required_array_given_as_none_is_refused_by_name():
    call = _Call.gather(None, key=None, slot_mapping=None)
    with pytest.raises(ArgumentError, match=r"key: None, expected an array \(it is required\)"):
        call["key"]
    assert call.get("key") is None  # optional arrays are asked for with get


class StreamProtocol:
    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return 0, self.handle


@pytest.mark.parametrize("handle", [-1, 2**64, 1.5, "7", None])
def test_a_cuda_stream_handle_out_of_range_is_refused(handle):
    with pytest.raises(InvalidValueError, match=r"stream.__cuda_stream__\(\)\[1\] = "):
        _device.stream_handle(StreamProtocol(handle))


@pytest.mark.parametrize("handle", [0, 1, 2**64 - 1])
def test_cuda_stream_handles_in_range_are_taken(handle):
    assert _device.stream_handle(StreamProtocol(handle)) == handle
