"""One donor -> receiver transfer over gloo (two real processes): the pack of small tensors,
a large tensor received in place (in one chunk or several), and a flipped bit caught by its
checksum (xxh3 on the host, and the device checksum a GPU uses, computed here on the CPU)."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("checksum", ["xxh3", "words"])
def test_a_large_tensor_in_several_chunks_arrives_in_order_and_a_flip_in_one_is_refused(
    checksum: str,
) -> None:
    """The donor's chunk size travels in the header (512 KiB here: the 2 MiB tensor in 4
    messages, all posted at once on the receiver); each chunk has its own checksum, of the
    kind the header names."""
    args = (False, 512 << 10, 0, checksum)
    whole = run_ranks(transfer_job, 2, args=args, timeout=60)[1].get()
    assert whole["problem"] is None and whole["same"] and whole["in_place"]
    assert whole["nbytes"] == (2 << 20) + 10 * 8 + 4
    args = (True, 512 << 10, 2, checksum)
    flipped = run_ranks(transfer_job, 2, args=args, timeout=60)[1].get()
    assert flipped["problem"] == "entry 'big' from rank 0 failed its checksum"


def test_the_device_checksum_sees_every_flipped_bit_and_moved_word() -> None:
    """``words_digest`` (what a GPU computes in place of xxh3): any slice of a buffer, at any
    alignment, with a tail of odd bytes; one flipped bit anywhere, two words swapped, a byte
    more or less all change it; the same bytes always give the same value."""
    from trainguard.live._transfer import words_digest

    base = torch.randint(
        0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    for offset in (0, 1, 3, 8):
        for n in (1, 7, 8, 9, 1000):
            t = base[offset : offset + n]
            value = int(words_digest(t))
            assert int(words_digest(t.clone())) == value
            for at in {0, n // 2, n - 1}:
                for bit in (0, 7):
                    flipped = t.clone()
                    flipped[at] ^= 1 << bit
                    assert int(words_digest(flipped)) != value, (offset, n, at, bit)
            assert int(words_digest(base[offset : offset + n + 1])) != value
    words = base[:64].clone().view(torch.int64)
    swapped = words[[1, 0, *range(2, 8)]]
    assert int(words_digest(swapped.view(torch.uint8))) != int(
        words_digest(words.view(torch.uint8))
    )
    assert int(words_digest(torch.empty(0, dtype=torch.uint8))) == 0


def test_a_checksum_the_wire_device_cannot_compute_is_refused() -> None:
    from trainguard.live import _transfer

    with pytest.raises(ValueError, match="checksum='md5'"):
        _transfer.prepare({"x": torch.ones(3)}, 1, checksum="md5")
