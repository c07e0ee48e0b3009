"""A weight-sync payload on its way to an engine in another process (vLLM's engine core and worker processes:
``rollout.executor: mp``), packed into byte buffers that travel without a copy through the host on a GPU.

`pack_buckets` packs the tensors of a payload (`jetrl.rollout.sync.trainer_payload`: HF name -> tensor, or
(FP8 bytes, scales)) into `Parcel`s of at most ``bucket_bytes`` each, keeping together the entries the caller
says must arrive together (the parts of one per-tensor-quantized weight). On CUDA a parcel carries a CUDA IPC
handle of its buffer (`torch.multiprocessing.reductions.reduce_tensor`): the worker maps the trainer's memory
on the same GPU and copies from it. On a CPU it carries the buffer by value. `Parcel.open` (in the worker)
gives back the entries as views of the buffer, with their dtypes and shapes; the sync then proves by digest
that the engine holds exactly the trainer's bytes, whichever way they came.

The sender keeps each buffer alive until the worker's call for it has returned (the call is synchronous and
the worker synchronizes its device before returning), and holds one parcel's buffer at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from jetrl.quant import ceil_div

__all__ = ["Parcel", "pack_buckets", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 1 << 30
"""Bytes per parcel (1 GiB): the extra device memory a sync to an out-of-process engine holds at once."""
_ALIGN = 256  # every entry starts at a multiple of this many bytes (any dtype's element size divides it)


@dataclass
class Parcel:
    """Entries of a payload packed into one byte buffer. `index`: (name, part, dtype, shape, offset, nbytes),
    part -1 for a plain tensor, 0 / 1 for the bytes / scales of an FP8 pair. Exactly one of `handle` (a CUDA
    IPC handle: ``(rebuild, args)`` of `reduce_tensor`) and `data` (the CPU buffer itself) is set."""

    index: list[tuple[str, int, str, tuple[int, ...], int, int]]
    nbytes: int
    handle: tuple[Any, tuple] | None = None
    data: torch.Tensor | None = None

    def open(self) -> dict:
        """The entries (as `trainer_payload` gives them), views of the parcel's buffer; call in the receiver."""
        if self.handle is not None:
            rebuild, args = self.handle
            buf = rebuild(*args)
        elif self.data is not None:
            buf = self.data
        else:
            raise ValueError("Parcel.open: the parcel carries neither a CUDA IPC handle nor data")
        if buf.numel() != self.nbytes:
            raise ValueError(f"Parcel.open: buffer of {buf.numel()} bytes, the index says {self.nbytes}")
        out: dict = {}
        for name, part, dtype, shape, off, n in self.index:
            t = buf[off : off + n].view(getattr(torch, dtype)).view(shape)
            if part < 0:
                out[name] = t
            else:
                out.setdefault(name, [None, None])[part] = t
        return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}


def _pieces(name: str, value) -> list[tuple[str, int, torch.Tensor]]:
    if isinstance(value, tuple):
        return [(name, i, t) for i, t in enumerate(value)]
    return [(name, -1, value)]


def _size(t: torch.Tensor) -> int:
    return ceil_div(t.numel() * t.element_size(), _ALIGN) * _ALIGN


def _pack(entries: list[tuple[str, int, torch.Tensor]]) -> tuple[torch.Tensor, list]:
    total = sum(_size(t) for _, _, t in entries)
    device = entries[0][2].device
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    index, off = [], 0
    for name, part, t in entries:
        if t.device != device:
            raise ValueError(f"pack_buckets: {name!r} is on {t.device}, the payload's other tensors on {device}")
        n = t.numel() * t.element_size()
        buf[off : off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        index.append((name, part, str(t.dtype).removeprefix("torch."), tuple(t.shape), off, n))
        off += _size(t)
    return buf, index


def pack_buckets(
    payload: dict, groups: Iterable[list[str]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[tuple[list[str], Parcel]]:
    """Pack `payload` into parcels, one at a time: yields ``(names, parcel)``, every name of `groups` (lists of
    payload names that must travel together, each name in exactly one group) in one parcel, a parcel holding
    groups until the next would take it past `bucket_bytes` (a group larger than that travels alone). Send
    each parcel before asking for the next: its buffer is dropped then, so at most one is held at a time."""
    if bucket_bytes < 1:
        raise ValueError(f"pack_buckets: bucket_bytes={bucket_bytes}; must be >= 1")
    groups = [list(g) for g in groups]
    named = [n for g in groups for n in g]
    if sorted(named) != sorted(payload):
        missing, extra = sorted(set(payload) - set(named)), sorted(set(named) - set(payload))
        dup = sorted({n for n in named if named.count(n) > 1})
        raise ValueError(
            f"pack_buckets: groups must name every payload entry once (missing {missing}, unknown {extra}, "
            f"repeated {dup})"
        )
    buckets: list[list[str]] = []
    size = 0
    for g in groups:
        gsize = sum(_size(t) for n in g for _, _, t in _pieces(n, payload[n]))
        if not buckets or size + gsize > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1] += g
        size += gsize
    for names in buckets:
        buf, index = _pack([p for n in names for p in _pieces(n, payload[n])])
        on_gpu = buf.is_cuda
        if on_gpu:
            from torch.multiprocessing.reductions import reduce_tensor

            torch.cuda.current_stream(buf.device).synchronize()  # the copies are done before the receiver reads
            parcel = Parcel(index, buf.numel(), handle=reduce_tensor(buf))
        else:
            parcel = Parcel(index, buf.numel(), data=buf)
        yield names, parcel
        del buf, parcel
        if on_gpu:
            torch.cuda.ipc_collect()  # free the IPC blocks the receiver has let go of
