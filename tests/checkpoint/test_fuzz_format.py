"""Property-based fuzzing of the checkpoint file reader (hypothesis).

Random valid states round-trip bit-exactly; random damage to a valid file (bytes flipped,
header fields replaced, truncation anywhere, a rewritten skeleton) either loads bit-exactly or
raises CheckpointCorruptError, never anything else, never a hang (the deadline) and never an
allocation beyond the file's size (tracemalloc's peak, and the size of every tensor returned).

The profile is fixed and database-less (``derandomize``): every run explores the same cases,
so CI is stable; change ``_SEED_SALT`` below to explore others locally.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
import tracemalloc
from datetime import timedelta
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.checkpoint._craft import file_bytes, join, raw_bytes, split, with_skeleton
from trainguard.checkpoint.format.read import load_buffer
from trainguard.errors import CheckpointCorruptError, CheckpointPickleError

_SEED_SALT = 0  # part of every example's key under derandomize: bump it to explore afresh


def _profile(examples: int) -> settings:
    return settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=timedelta(seconds=5),  # a hang fails the example
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )


_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.bool,
    torch.complex64,
    torch.complex128,  # no safetensors code: stored as bytes
]


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    nbytes = math.prod(shape) * dtype.itemsize
    raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
    if dtype == torch.bool:  # only 0 and 1 are valid bools
        raw = bytes(b & 1 for b in raw)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if nbytes else torch.empty(0)
    t = t.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
    view = draw(st.sampled_from(["same", "t", "slice"]))
    if view == "t" and t.dim() >= 2:
        return t.transpose(0, 1)
    if view == "slice" and t.dim() >= 1:
        return t[::2]
    return t


@st.composite
def _shared(draw: st.DrawFn) -> list[torch.Tensor]:
    """Views of one storage: written once, sharing memory again after loading."""
    base = draw(_tensors())
    flat = base.reshape(-1)
    if flat.numel() < 2:
        return [base]
    return [base, flat[1:], flat[: flat.numel() // 2]]


_KEYS = st.one_of(
    st.text(max_size=8),
    st.integers(-(2**63), 2**64),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False, allow_infinity=False),
)
_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64),
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.sampled_from(_DTYPES),
    st.lists(st.integers(0, 9), max_size=3).map(torch.Size),
    _tensors(),
    _shared(),
)
_STATES = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(_KEYS, inner, max_size=4),
    ),
    max_leaves=12,
)


def _same(a: Any, b: Any) -> bool:
    """Bit-exact equality: types, dtypes, shapes, bytes; -0.0 is not 0.0 (Python float NaNs
    compare as NaN: JSON keeps no NaN payload for them)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return bool(torch.equal(raw_bytes(a), raw_bytes(b)))
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict):
        ka, kb = list(a), list(b)
        return len(ka) == len(kb) and all(
            _same(x, y) and _same(a[x], b[y]) for x, y in zip(ka, kb, strict=True)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _load_bounded(blob: bytes) -> Any:
    """Load ``blob`` from memory; the allocations it makes stay within the file's size."""
    data = bytearray(blob)
    tracemalloc.start()
    try:
        state, _ = load_buffer(data, "fuzz")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 4 * len(blob) + (1 << 20), f"{peak} bytes allocated for {len(blob)}"
    for t in _tensors_in(state):
        assert t.numel() * t.element_size() <= len(blob)
    return state


def _tensors_in(node: Any) -> list[torch.Tensor]:
    if isinstance(node, torch.Tensor):
        return [node]
    if isinstance(node, dict):
        return [t for v in node.values() for t in _tensors_in(v)]
    if isinstance(node, (list, tuple)):
        return [t for v in node for t in _tensors_in(v)]
    return []


def _loads_same_or_corrupt(blob: bytes, original: Any) -> None:
    try:
        state = _load_bounded(blob)
    except CheckpointCorruptError:
        return
    assert _same(state, original)


@_profile(150)
@given(state=_STATES)
def test_random_states_round_trip_bit_exactly(state: Any) -> None:
    assert _same(
        _load_bounded(file_bytes({"s": state, "salt": _SEED_SALT})),
        {"s": state, "salt": _SEED_SALT},
    )


_SMALL_STATES = _STATES.filter(lambda s: bool(_tensors_in(s))).map(lambda s: {"s": s})


@_profile(300)
@given(state=_SMALL_STATES, data=st.data())
def test_flipped_bytes_load_bit_exactly_or_are_corrupt(state: Any, data: st.DataObject) -> None:
    blob = bytearray(file_bytes(state))
    (n,) = struct.unpack("<Q", blob[:8])
    where = data.draw(
        st.one_of(  # the length, the JSON text (not its padding), the data: equally often
            st.integers(0, 7),
            st.integers(8, 8 + len(json.dumps(split(bytes(blob))[0])) - 1),
            st.integers(8 + n, len(blob) - 1) if len(blob) > 8 + n else st.integers(0, 7),
        )
    )
    for _ in range(data.draw(st.integers(1, 3))):
        blob[where] ^= data.draw(st.integers(1, 255))
        where = min(len(blob) - 1, where + data.draw(st.integers(0, 16)))
    _loads_same_or_corrupt(bytes(blob), state)


@_profile(150)
@given(state=_SMALL_STATES, data=st.data())
def test_truncation_at_any_offset_is_corrupt(state: Any, data: st.DataObject) -> None:
    blob = file_bytes(state)
    cut = data.draw(st.integers(0, len(blob) - 1))
    _loads_same_or_corrupt(blob[:cut], state)


_JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(),
        st.text(max_size=12),
        st.sampled_from(["F32", "U8", "BOOL", "nan", "T", "D", "0" * 16]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


@_profile(200)
@given(state=_SMALL_STATES, data=st.data())
def test_header_fields_changed_load_bit_exactly_or_are_corrupt(
    state: Any, data: st.DataObject
) -> None:
    header, section = split(file_bytes(state))
    name = data.draw(st.sampled_from(sorted(header)))
    fields = header[name]
    key = data.draw(st.sampled_from(sorted(fields)))
    fields[key] = data.draw(
        st.one_of(
            _JSON,
            st.just(fields[key]).map(lambda v: v[::-1] if isinstance(v, list) else v),
            st.lists(st.integers(-(2**65), 2**65), min_size=2, max_size=2),
        )
    )
    if data.draw(st.booleans()):
        header[data.draw(st.text(max_size=4))] = data.draw(_JSON)
    _loads_same_or_corrupt(join(header, section), state)


def _nodes(node: Any) -> list[Any]:
    """Every JSON container in a skeleton (iteratively: the skeleton is bounded anyway)."""
    out, stack = [], [node]
    while stack:
        node = stack.pop()
        if isinstance(node, (dict, list)):
            out.append(node)
            stack.extend(node.values() if isinstance(node, dict) else node)
    return out


@_profile(200)
@given(state=_SMALL_STATES, data=st.data())
def test_rewritten_skeletons_load_or_are_corrupt(state: Any, data: st.DataObject) -> None:
    """Someone rewrites the skeleton and fixes its checksum (a crafted file): the file loads
    (some state) or is refused; a pickled leaf it declares needs allow_pickle, as it should."""
    header, section = split(file_bytes(state))
    skeleton = json.loads(header["__metadata__"]["skeleton"])
    target = data.draw(st.sampled_from(_nodes(skeleton)))
    if isinstance(target, dict) and target:
        target[data.draw(st.sampled_from(sorted(target)))] = data.draw(_JSON)
    elif isinstance(target, list) and target:
        target[data.draw(st.integers(0, len(target) - 1))] = data.draw(_JSON)
    blob = join(with_skeleton(header, json.dumps(skeleton)), section)
    with contextlib.suppress(CheckpointCorruptError, CheckpointPickleError):
        _load_bounded(blob)
