"""Launch values in device memory: what a kernel replayed by a CUDA graph reads instead of its arguments.

A launch's host scalars (the spec's bias corrections, the learning rate, ...) and its stochastic-rounding key
change every step; passed as kernel arguments, a CUDA graph would replay the captured step's. Here each launch
slot owns one int32 row of a device table, which its kernel reads (`tile_kernels.launch_values`, HOST_IN_TABLE
>= 0): the fp32 bit pattern of each host scalar, then the key. The host writes every slot's row for the coming
step into a staging buffer and copies the whole table to the device in one copy, on the current stream, before
the launches (or the graph replay) that read it:

    table = HostTable(slots, device)
    table.stage(slot, exports, key)   # `kernel_calls.kernel_host_values`' scalars and a `mix_seed` key
    table.upload()                    # one copy; the staging buffer is reused once that copy has run
    row = table.row(slot)             # int32 [ROW_WORDS]: the HOST argument of the slot's launches

The values are the ones a by-value launch passes, bit for bit: the host computes them with the same code.
"""

from __future__ import annotations

import struct
from typing import Optional, Sequence

import torch

__all__ = ["HostTable", "ROW_WORDS", "encode_row"]

# int32 words per row: up to ROW_WORDS - 1 host scalars and the key; a multiple of 4, so every row starts on 16
# bytes (Triton specializes a pointer on 16-byte alignment: one compiled kernel for every row)
ROW_WORDS = 32
_FP32_EXACT_INT = 2**24  # an integer host value beyond this would be rounded twice (to float64, then fp32)


def encode_row(exports: Sequence, key: int) -> list[int]:
    """One table row (ROW_WORDS int32 values) for host scalars `exports` (floats already rounded to fp32, ints,
    bools) and the rounding key `key` in [0, 2**31).

    Raises:
        ValueError: more than ROW_WORDS - 1 host scalars, an int the fp32 a kernel reads cannot hold exactly,
            or a key out of range.
    """
    if len(exports) > ROW_WORDS - 1:
        raise ValueError(f"a launch table row holds {ROW_WORDS - 1} host scalars, this update has {len(exports)}")
    words = []
    for value in exports:
        if type(value) in (int, bool) and abs(int(value)) > _FP32_EXACT_INT:
            raise ValueError(f"the integer host value {value} has no exact fp32 for a launch table")
        words.append(struct.unpack("<i", struct.pack("<f", float(value)))[0])
    if not 0 <= int(key) < 2**31:
        raise ValueError(f"the rounding key must be in [0, 2**31), got {key}")
    words.append(int(key))
    return words + [0] * (ROW_WORDS - len(words))


class HostTable:
    """`slots` rows of launch values on `device` (int32 [slots, ROW_WORDS]), staged on the host and copied in one
    go. On CUDA the copy comes from one of two pinned buffers, used in turn, each refilled only after the copy
    that last read it has run (the host may run a step ahead of the GPU)."""

    def __init__(self, slots: int, device: torch.device) -> None:
        self.device = torch.device(device)
        self.rows = torch.zeros(max(slots, 1), ROW_WORDS, dtype=torch.int32, device=self.device)
        self._values = torch.zeros(self.rows.shape, dtype=torch.int32)  # every row as last staged, on the host
        cuda = self.device.type == "cuda"
        self._staging = [torch.zeros(self.rows.shape, dtype=torch.int32, pin_memory=True) for _ in range(2)] \
            if cuda else [self._values]
        self._copied: list[Optional[torch.cuda.Event]] = [None] * len(self._staging)
        self._next = 0

    def row(self, slot: int) -> torch.Tensor:
        """The device row of `slot`: int32 [ROW_WORDS], what its launches take as HOST."""
        return self.rows[slot]

    def stage(self, slot: int, exports: Sequence, key: int) -> None:
        """The values of `slot`'s next launches (`encode_row`); they reach the device at `upload`."""
        self._values.numpy()[slot] = encode_row(exports, key)

    def upload(self) -> None:
        """Copy every row as last staged to the device, on the current stream (in one copy)."""
        if self.device.type != "cuda":
            self.rows.copy_(self._values)
            return
        i = self._next
        self._next = 1 - i
        if self._copied[i] is not None:
            self._copied[i].synchronize()  # the copy that last read this buffer has run
        self._staging[i].copy_(self._values)
        self.rows.copy_(self._staging[i], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[i] = event
