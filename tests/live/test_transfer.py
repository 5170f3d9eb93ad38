"""One donor -> receiver transfer over gloo (two real processes): the pack of small tensors,
a large tensor received in place (in one chunk or several), and a flipped bit caught by its
checksum."""

from __future__ import annotations

from tests._dist import run_ranks
from tests.live._jobs import transfer_job


def test_a_transfer_arrives_bit_identical_and_large_tensors_land_in_place() -> None:
    got = [r.get() for r in run_ranks(transfer_job, 2, args=(False,), timeout=60)][1]
    assert got["problem"] is None and got["same"] and got["step"] == 3
    assert got["into"] == ["big"] and got["in_place"]
    assert got["nbytes"] == (2 << 20) + 10 * 8 + 4  # the 2 MiB tensor and the pack


def test_a_flipped_bit_in_a_large_tensor_is_refused() -> None:
    got = [r.get() for r in run_ranks(transfer_job, 2, args=(True,), timeout=60)][1]
    assert got["problem"] == "entry 'big' from rank 0 failed its checksum"


def test_a_large_tensor_in_several_chunks_arrives_in_order_and_a_flip_in_one_is_refused() -> None:
    """The donor's chunk size travels in the header (512 KiB here: the 2 MiB tensor in 4
    messages, all posted at once on the receiver); each chunk has its own checksum."""
    whole = run_ranks(transfer_job, 2, args=(False, 512 << 10), timeout=60)[1].get()
    assert whole["problem"] is None and whole["same"] and whole["in_place"]
    assert whole["nbytes"] == (2 << 20) + 10 * 8 + 4
    flipped = run_ranks(transfer_job, 2, args=(True, 512 << 10, 2), timeout=60)[1].get()
    assert flipped["problem"] == "entry 'big' from rank 0 failed its checksum"
