"""A safetensors file read in place: its header parsed here (8 bytes of length, then JSON: each tensor's dtype, shape
and byte range), its data memory-mapped read-only (`MappedFile`; `Safetensors`: over bytes already read, as a LoRA
adapter's, hashed as they are parsed), each tensor a zero-copy torch view of the mapping.

The loader (gpu/loading/weights.py) copies a tensor into its destination, then `release`s it: the range's pages leave
this process (`MADV_DONTNEED`; they stay in the page cache for the next start), so the load's resident memory grows by
the destinations alone, never by the files (safetensors' `safe_open` keeps every page it read mapped until it closes:
a bf16 checkpoint loaded that way peaks at its served bytes plus its own). A file that is not safetensors, or whose
header does not fit it, raises ModelLoadError naming the file.
"""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from pathlib import Path

import torch

from gpu.loading.errors import ModelLoadError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
MAX_HEADER = 100 << 20  # (safetensors' own bound)


class Safetensors:
    """A safetensors file's bytes (`buffer`: read, or a mapping), its header checked, each tensor a zero-copy view."""

    def __init__(self, path: Path, buffer) -> None:
        self.path, self.map = path, buffer
        self.header = self._header()
        self.data = 8 + struct.unpack_from("<Q", self.map)[0]

    def _header(self) -> dict[str, dict]:
        try:
            (length,) = struct.unpack_from("<Q", self.map)
            if not 0 < length <= min(MAX_HEADER, len(self.map) - 8):
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(self.map[8 : 8 + length])
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            header.pop("__metadata__", None)
            end = len(self.map) - 8 - length
            for name, t in header.items():
                begin, stop = t["data_offsets"]
                if not all(type(d) is int and d >= 0 for d in (*t["shape"], begin, stop)):  # (no bool, no float)
                    raise ValueError(f"{name}'s shape {t['shape']} or offsets are not sizes")
                size = DTYPES[t["dtype"]].itemsize * int(torch.Size(t["shape"]).numel())
                if not 0 <= begin <= stop <= end or stop - begin != size:
                    raise ValueError(f"{name}'s bytes {begin}..{stop} do not fit its shape or the file")
        except (struct.error, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{self.path}: not a safetensors file ({e})") from e
        return header

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def kind(self, name: str) -> None:
        """(a GGUF file's tensors have a block format: gpu/loading/gguf_file.py; these are plain)"""
        return None

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor as a read-only view of the mapping (the mapping lives as long as a view of it)."""
        t = self.header[name]
        begin, stop = (self.data + o for o in t["data_offsets"])
        dtype = DTYPES[t["dtype"]]
        if begin == stop:
            return torch.empty(t["shape"], dtype=dtype)
        with warnings.catch_warnings():  # (torch warns that the buffer is not writable: it is not written)
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(memoryview(self.map)[begin:stop], dtype=dtype).view(t["shape"])


class MappedFile(Safetensors):
    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            try:
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # (an empty file)
                raise ModelLoadError(f"{path}: not a safetensors file ({e})") from e
        super().__init__(path, mapping)

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process (whole pages inside its range; the file's pages stay cached)."""
        begin, stop = (self.data + o for o in self.header[name]["data_offsets"])
        first, last = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE, stop // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            self.map.madvise(mmap.MADV_DONTNEED, first, last - first)
