"""Activation offloading: the tensors autograd saves for backward kept in pinned host memory, bit for bit.

With activation checkpointing, what a forward saves outside the checkpointed layers is their inputs: one
[tokens, hidden] tensor a layer (2 GiB for Llama-3.1-8B at 8192 tokens, bf16), held on the GPU until backward
reaches the layer. `OffloadActivations` copies each such tensor to pinned host memory on a side stream as it is
saved, frees the GPU copy once the transfer is done, and in backward brings it back, starting the copy of the
tensor saved just before it while the current one is used (backward unpacks in the reverse order of the forward).
The values are copied, never recomputed or converted: gradients and updates are the same bits as without it.

    offload = forge_dsl.OffloadActivations()
    for batch in loader:
        with offload:                      # only the forward: what is saved while entered is offloaded
            loss = model(**batch).loss
        loss.backward()
        opt.step(); opt.zero_grad()

Only tensors worth a transfer are moved: on the offloaded device type, at least `min_bytes`, contiguous and
covering their whole storage (a view of a larger tensor would free nothing), plain tensors (not parameters, which
FORGE's fused backward updates in place, nor subclasses such as DTensor shards), not leaves that require grad. A
tensor saved twice while its copy lives (rotary tables passed to every layer) is copied once. Every saved tensor,
moved or not, keeps autograd's check: one modified in place after it was saved is refused when backward unpacks it
(the hooks replace autograd's own check, so they make it themselves).

`device="cpu"` offloads CPU tensors into separate CPU buffers with synchronous copies: it frees nothing and exists
so that the bookkeeping runs, and is tested, on machines without a GPU.
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch

#: How many saves back from an unpacked tensor to look for the next one to prefetch (skipping ones on the device).
PREFETCH_LOOKBACK = 8


class _Offloaded:
    """One saved tensor's host copy, and while the device→host transfer runs, the device tensor it came from.

    host: the copy, pinned on CUDA; source: the device tensor (detached: holding it must not hold its graph)
    until its transfer is done, None after; origin: the tensor saved, weakly, and version: its version then (a
    later in-place change is refused at unpack); copied: the event after which `host` holds the values;
    prefetched: (device tensor, event) of a host→device copy started ahead of its unpack; restored: the device
    tensor last unpacked, weakly, with its version (a tensor saved by several operations comes back once while
    one of them holds it unchanged)."""

    __slots__ = ("host", "device", "source", "origin", "version", "copied", "prefetched", "restored", "__weakref__")

    def __init__(self, host: torch.Tensor, source: torch.Tensor, copied) -> None:
        self.host = host
        self.device = source.device
        self.source: Optional[torch.Tensor] = source.detach()
        self.origin = weakref.ref(source)
        self.version = source._version
        self.copied = copied
        self.prefetched = None
        self.restored: Optional[tuple] = None  # (weak reference, its version when unpacked)

    def check_unmodified(self) -> None:
        """A RuntimeError if the tensor saved was changed in place since (its source shares its version counter;
        once the source is released, the tensor saved is asked, if it still lives)."""
        alias = self.source if self.source is not None else self.origin()
        if alias is not None:
            _check_version(self.version, alias)

    def on_device(self) -> Optional[torch.Tensor]:
        """The values on the device now, if they are: the source while its transfer runs, or the tensor last
        unpacked while it lives unchanged; else None."""
        if self.source is not None:
            return self.source
        restored = self.restored[0]() if self.restored is not None else None
        return restored if restored is not None and restored._version == self.restored[1] else None


class Kept:
    """What a pack hook returns for a tensor that stays where it is (`OffloadActivations`' for the ones it does not
    move, and any other hooks'): the tensor detached (a tensor saved by the operation that made it must not hold its
    own graph: the hooks' documented rule) and its version then, for `unpack` to make autograd's in-place check,
    which saved-tensor hooks replace."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()
        self.version = tensor._version

    def unpack(self) -> torch.Tensor:
        """The tensor saved; a RuntimeError if it was modified in place since."""
        _check_version(self.version, self.tensor)
        return self.tensor


class _Saved:
    """What the pack hook returns for an offloaded tensor: its entry, and the save's place in the order of saves
    (a tensor saved several times has one entry and several places)."""

    __slots__ = ("entry", "order")

    def __init__(self, entry: _Offloaded, order: int) -> None:
        self.entry = entry
        self.order = order


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """While entered, the tensors autograd saves (see the module's docstring for which) go to host memory.

    min_bytes: the smallest tensor moved (default 1 MiB: below it a transfer costs more than it frees).
    device: the device type whose tensors are moved ("cuda"; "cpu" runs the same bookkeeping with synchronous
    copies, for tests). prefetch: start bringing back the tensor saved before the one backward unpacks (default
    True; False copies each back when it is unpacked, on the compute stream). max_in_flight_bytes: how many bytes
    of saved tensors may wait for their copy to the host (default 256 MiB); beyond it, saving waits for the oldest
    copy. The host queues work far ahead of the GPU, and a tensor's device memory can only be reused once its copy
    ran: without this bound, a forward whose host runs ahead would hold every saved tensor on the device anyway.

    Reusable: enter it once a forward. Backward may run after exiting. Streams: device→host copies run on a side
    stream after what the compute stream had queued when the tensor was saved; the compute stream waits for a
    host→device copy before using its result."""

    def __init__(self, min_bytes: int = 1 << 20, device: str = "cuda", prefetch: bool = True,
                 max_in_flight_bytes: int = 256 << 20) -> None:
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int):
            raise TypeError(f"OffloadActivations(): min_bytes must be an int, not {type(min_bytes).__name__}.")
        if min_bytes < 0:
            raise ValueError(f"OffloadActivations(): min_bytes must be >= 0, got {min_bytes}.")
        if device not in ("cuda", "cpu"):
            raise ValueError(f"OffloadActivations(): device must be 'cuda' or 'cpu', got {device!r}.")
        if not isinstance(prefetch, bool):
            raise TypeError(f"OffloadActivations(): prefetch must be a bool, not {type(prefetch).__name__}.")
        if isinstance(max_in_flight_bytes, bool) or not isinstance(max_in_flight_bytes, int):
            raise TypeError("OffloadActivations(): max_in_flight_bytes must be an int, not "
                            f"{type(max_in_flight_bytes).__name__}.")
        if max_in_flight_bytes < 0:
            raise ValueError(f"OffloadActivations(): max_in_flight_bytes must be >= 0, got {max_in_flight_bytes}.")
        self.max_in_flight_bytes = max_in_flight_bytes
        self.min_bytes = min_bytes
        self.device_type = device
        self.prefetch = prefetch
        self._lock = threading.Lock()  # backward unpacks on autograd's threads, one a device
        self._streams: dict = {}  # device -> side stream for the copies
        self._pending: list[_Offloaded] = []  # device→host copies whose source is still held
        self._by_order: dict[int, weakref.ref] = {}  # place in the order of saves -> entry, to prefetch backwards
        self._by_tensor: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # id(tensor) -> (tensor, its entry)
        self._saves = 0
        #: bytes copied to the host, copied back, and of those copied back ahead of their unpack, since
        #: construction (what the transfers cost)
        self.bytes_offloaded = 0
        self.bytes_restored = 0
        self.bytes_prefetched = 0
        super().__init__(self.pack, self.unpack)

    def __enter__(self):
        with self._lock:
            self._forget_dead()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        with self._lock:
            self._release_copied()

    # ---- the hooks -------------------------------------------------------------------------------------------

    def pack(self, tensor: torch.Tensor):
        """The saved-tensor pack hook: a `Kept` (the tensor stays), or a `_Saved` whose host copy is on its way."""
        if not self._offloadable(tensor):
            return Kept(tensor)
        with self._lock:
            return self._pack(tensor)

    def unpack(self, saved):
        """The saved-tensor unpack hook: the device tensor with the values saved."""
        if isinstance(saved, Kept):
            return saved.unpack()
        with self._lock:
            return self._unpack(saved)

    @staticmethod
    def moved(packed) -> bool:
        """Whether what `pack` returned is on its way to host memory (else the tensor stayed where it was)."""
        return isinstance(packed, _Saved)

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        shared = self._by_tensor.get(id(tensor))
        entry = None
        if shared is not None:
            known, entry = shared[0](), shared[1]()
            if known is not tensor or entry is None or entry.version != tensor._version:
                entry = None
        if entry is None:
            self._release_copied()
            entry = self._copy_to_host(tensor)
            self._by_tensor[id(tensor)] = (weakref.ref(tensor), weakref.ref(entry))
        order, self._saves = self._saves, self._saves + 1
        self._by_order[order] = weakref.ref(entry)
        return _Saved(entry, order)

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        packed = saved.entry
        self._release_copied()
        packed.check_unmodified()
        tensor = packed.on_device()
        if tensor is None:
            if packed.prefetched is not None:
                tensor, ready = packed.prefetched
                packed.prefetched = None
                if ready is not None:
                    stream = torch.cuda.current_stream(packed.device)
                    stream.wait_event(ready)
                    tensor.record_stream(stream)
            else:
                tensor = self._copy_to_device(packed)
            packed.restored = (weakref.ref(tensor), tensor._version)
        if self.prefetch:
            self._prefetch_before(saved.order)
        return tensor

    # ---- which tensors ---------------------------------------------------------------------------------------

    def _offloadable(self, tensor: torch.Tensor) -> bool:
        if type(tensor) is not torch.Tensor or tensor.device.type != self.device_type:
            return False  # a Parameter, a DTensor or another subclass; another device
        if tensor.is_leaf and tensor.requires_grad:
            return False
        nbytes = tensor.nbytes
        if nbytes < max(self.min_bytes, 1) or tensor.layout != torch.strided or not tensor.is_contiguous():
            return False
        storage = tensor.untyped_storage()
        return tensor.storage_offset() == 0 and storage.nbytes() == nbytes

    # ---- transfers -------------------------------------------------------------------------------------------

    def _side_stream(self, device: torch.device):
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _copy_to_host(self, tensor: torch.Tensor) -> _Offloaded:
        self.bytes_offloaded += tensor.nbytes
        if tensor.device.type == "cpu":
            entry = _Offloaded(tensor.clone(), tensor, None)
            entry.source = None  # a synchronous copy: done
            return entry
        compute = torch.cuda.current_stream(tensor.device)
        side = self._side_stream(tensor.device)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        side.wait_stream(compute)  # the values as they are when saved
        with torch.cuda.stream(side):
            host.copy_(tensor, non_blocking=True)
        copied = side.record_event()
        entry = _Offloaded(host, tensor, copied)
        self._pending.append(entry)
        self._bound_in_flight()
        return entry

    def _release_copied(self) -> None:
        """Drop the device tensors whose host copies are done."""
        still = []
        for entry in self._pending:
            if entry.copied.query():
                entry.source = None
            else:
                still.append(entry)
        self._pending = still

    def _bound_in_flight(self) -> None:
        """Wait (on the host) for the oldest copies to the host until at most max_in_flight_bytes are in flight
        beside the newest one, and release their device tensors."""
        while len(self._pending) > 1 and sum(e.host.nbytes for e in self._pending[:-1]) > self.max_in_flight_bytes:
            self._pending[0].copied.synchronize()
            self._release_copied()

    def _copy_to_device(self, entry: _Offloaded) -> torch.Tensor:
        """The host copy back on the device, on the compute stream (ordered before whatever uses it)."""
        self.bytes_restored += entry.host.nbytes
        if entry.device.type == "cpu":
            return entry.host.clone()
        return entry.host.to(entry.device, non_blocking=True)

    def _prefetch_before(self, order: int) -> None:
        """Start bringing back the tensor of the nearest save before `order` whose values are only on the host."""
        for earlier in range(order - 1, max(order - 1 - PREFETCH_LOOKBACK, -1), -1):
            ref = self._by_order.get(earlier)
            entry = ref() if ref is not None else None
            if entry is None or entry.on_device() is not None:
                continue
            if entry.prefetched is not None:
                return
            self.bytes_prefetched += entry.host.nbytes
            if entry.device.type == "cpu":
                entry.prefetched = (self._copy_to_device(entry), None)
                return
            compute = torch.cuda.current_stream(entry.device)
            side = self._side_stream(entry.device)
            self.bytes_restored += entry.host.nbytes
            tensor = torch.empty(entry.host.shape, dtype=entry.host.dtype, device=entry.device)  # compute's pool
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                tensor.copy_(entry.host, non_blocking=True)
            tensor.record_stream(side)
            entry.prefetched = (tensor, side.record_event())
            return

    def _forget_dead(self) -> None:
        self._by_order = {i: r for i, r in self._by_order.items() if r() is not None}
        self._by_tensor = {k: v for k, v in self._by_tensor.items() if v[0]() is not None and v[1]() is not None}


def _check_version(saved: int, tensor: torch.Tensor) -> None:
    """Autograd's check on a saved tensor, which saved-tensor hooks replace: refused if changed in place."""
    if tensor._version != saved:
        raise RuntimeError(
            "OffloadActivations: one of the tensors saved for backward was modified by an in-place operation after "
            f"it was saved (its version was {saved}, it is {tensor._version} now), as autograd itself would refuse. "
            "Clone it before modifying it in place, or change the operation to an out-of-place one.")
