"""A GGUF file read in place (llama.cpp's format, version 2 or 3): the header and metadata parsed here (gguf-py's
GGUFReader parses every field through numpy records: seconds for a large vocabulary), the data memory-mapped
read-only, each tensor a zero-copy view of the mapping: a block tensor's view is the weight itself (`hold`: its
pages read in and kept), another tensor's pages released once copied (as gpu/loading/mapped.py's safetensors file:
the same interface).

Names: the file's (`blk.0.attn_q.weight`) are given the checkpoint names the model loads (`model.layers.0.self_attn.
q_proj.weight`) through gguf-py's tensor-name map of the architecture: of the names it lists for a tensor, the one in
`wanted` (the HF names the family's checkpoints have). Values: F32, F16 and BF16 tensors are views in their dtype;
`raw` gives a block format's bytes (held as they are: gpu/layers/linear.py's blocks), and `tensor` any other type
dequantized by gguf-py (`gguf.quants.dequantize`, float32) tensor by tensor (a layer the block kernels cannot hold).
llama.cpp's converter permuted the rows of llama's q and k (rotary pairs interleaved): they are put back in HF's
order on read, as transformers does (a row permutation: exact); it stored Gemma's norms as 1 + w: read back as w
(float32's rounding of the subtraction, as transformers'). `rope_freqs.weight` (Llama 3.x's rotary factors) is
not a parameter: the loader divides the rotary frequencies by it, as llama.cpp does.
"""

from __future__ import annotations

import errno
import mmap
import re
import struct
import warnings
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import torch

from gpu.loading.errors import ModelLoadError

NATIVE = {gguf.GGMLQuantizationType.F32: torch.float32, gguf.GGMLQuantizationType.F16: torch.float16,
          gguf.GGMLQuantizationType.BF16: torch.bfloat16}  # fmt: skip
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # (a string's)
MADV_POPULATE_READ = 22  # (Linux 5.14's; not in Python 3.11's mmap)
PERMUTED = {"llama": ("q_proj", "k_proj")}  # the converter's rotary permutation of q and k rows
OFFSET_NORMS = ("gemma", "gemma2", "gemma3")  # norms stored as 1 + w (the model's RMSNorm adds the 1 itself)
_EXPERTS = re.compile(r"model\.layers\.(\d+)\..*\.experts\.(gate|up|down)$")  # (gpu/layers/moe.py's stacked weights)


class GGUFFile:
    def __init__(self, path: Path, wanted: set[str] | None = None, meta: dict | None = None) -> None:
        """`meta`: the first file's metadata, for the later files of a split model (theirs holds split.* only)."""
        self.path = path
        with open(path, "rb") as f:
            try:
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:
                raise ModelLoadError(f"{path}: not a GGUF file ({e})") from e
        try:
            self.meta, infos, self.data = self._parse()
        except (struct.error, ValueError, UnicodeDecodeError, OverflowError) as e:
            raise ModelLoadError(f"{path}: not a GGUF file ({e})") from e
        self.meta = {**(meta or {}), **self.meta}
        self.arch = self.meta.get("general.architecture", "")
        names = _checkpoint_names(self.arch, int(self.meta.get(f"{self.arch}.block_count", 0)), wanted)
        self.header = {names.get(name, name): info for name, info in infos.items()}

    def _parse(self) -> tuple[dict, dict, int]:
        m, pos = self.map, 0
        if m[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (2 and 3 are read)")
        pos, meta = 24, {}
        for _ in range(n_kv):
            key, pos = _string(m, pos)
            (kind,), pos = struct.unpack_from("<I", m, pos), pos + 4
            meta[key], pos = _value(m, pos, kind)
        infos = {}
        for _ in range(n_tensors):
            name, pos = _string(m, pos)
            (dims,), pos = struct.unpack_from("<I", m, pos), pos + 4
            shape, pos = (
                struct.unpack_from(f"<{dims}Q", m, pos)[::-1],
                pos + 8 * dims,
            )  # (ggml's order is innermost first)
            kind, offset = struct.unpack_from("<IQ", m, pos)
            pos += 12
            infos[name] = (gguf.GGMLQuantizationType(kind), tuple(int(n) for n in shape), offset)
        align = int(meta.get("general.alignment", 32))
        if align <= 0:
            raise ValueError(f"general.alignment {align}")
        return meta, infos, -(-pos // align) * align

    def as_reader(self) -> SimpleNamespace:
        """This file as transformers' config reader uses gguf-py's GGUFReader: `fields[key]`'s `parts`, `data` and
        `types`, the tensors' names (GGUFReader makes a numpy view of every part of every field: 10 s for SmolLM2's
        49k-token vocabulary and merges, and transformers reads the config twice, for itself and the tokenizer)."""
        names = [SimpleNamespace(name=name) for name in self.header]
        return SimpleNamespace(fields={key: _field(value) for key, value in self.meta.items()}, tensors=names)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.header[name][1]

    def _range(self, name: str) -> tuple[int, int]:
        kind, shape, offset = self.header[name]
        elems, size = gguf.GGML_QUANT_SIZES[kind]
        count = int(np.prod(shape, dtype=np.int64))
        begin = self.data + offset
        if count % elems or begin + count // elems * size > len(self.map):
            raise ModelLoadError(f"{self.path}: {name}'s {kind.name} data do not fit its shape or the file")
        return begin, begin + count // elems * size

    def kind(self, name: str) -> gguf.GGMLQuantizationType:
        return self.header[name][0]

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as rows, [rows, row bytes] uint8: a view of the mapping (read-only: never written), or
        for llama's q and k a copy with the rows put back in order."""
        begin, stop = self._range(name)
        with warnings.catch_warnings():  # (torch warns that the buffer is not writable: it is not written)
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(memoryview(self.map)[begin:stop], dtype=torch.uint8)
        shape = self.shape(name)
        return self._unpermute(name, raw.view(int(np.prod(shape[:-1], dtype=np.int64)), -1))

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor in HF's layout: a view of the mapping (F32/F16/BF16), else dequantized to float32."""
        kind, shape, _ = self.header[name]
        rows = self.raw(name)
        t = rows.view(NATIVE[kind]) if kind in NATIVE else torch.from_numpy(gguf.quants.dequantize(rows.numpy(), kind))
        if self.arch in OFFSET_NORMS and name.endswith("norm.weight"):  # (llama.cpp's converter stored 1 + w)
            return t.view(shape) - 1
        return t.view(shape)

    def _unpermute_of(self, name: str) -> str | None:
        return next((p for p in PERMUTED.get(self.arch, ()) if name.endswith(f"{p}.weight")), None)

    def _unpermute(self, name: str, t: torch.Tensor) -> torch.Tensor:
        which = self._unpermute_of(name)
        if which is None:
            return t
        heads = int(self.meta.get(f"{self.arch}.attention.head_count", 1))
        if which == "k_proj":  # (absent: as many KV heads as heads, llama.cpp's default)
            heads = int(self.meta.get(f"{self.arch}.attention.head_count_kv", heads))
        rows = t.shape[0]
        if rows % (2 * heads):
            raise ModelLoadError(f"{self.path}: {name} has {rows} rows, not pairs of rows for each of {heads} heads")
        t = t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        return t

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process (whole pages inside its range; the file's pages stay cached)."""
        first, last = self._pages(name, inner=True)
        if last > first:
            self.map.madvise(mmap.MADV_DONTNEED, first, last - first)

    def hold(self, name: str) -> None:
        """After `raw`'s bytes became a weight held in place (gpu/layers/linear.py's blocks): its pages are read in now
        (a served model's first request does not fault them in) and stay mapped; a permuted q or k was a copy, and
        its range is released."""
        if self._unpermute_of(name) is not None:
            return self.release(name)
        first, last = self._pages(name, inner=False)
        try:
            self.map.madvise(MADV_POPULATE_READ, first, last - first)
        except OSError as e:  # (else a kernel before 5.14, or a sandbox's: read ahead, faulted in as it is read)
            if e.errno in (errno.EFAULT, errno.EIO, getattr(errno, "EHWPOISON", errno.EIO)):
                raise ModelLoadError(f"{self.path}: cannot read {name}'s data: {e}") from e
            self.map.madvise(mmap.MADV_WILLNEED, first, last - first)

    def _pages(self, name: str, inner: bool) -> tuple[int, int]:
        """The range's whole pages (`inner`), or the pages it touches."""
        begin, stop = self._range(name)
        if inner:
            return -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE, stop // mmap.PAGESIZE * mmap.PAGESIZE
        return begin // mmap.PAGESIZE * mmap.PAGESIZE, min(-(-stop // mmap.PAGESIZE) * mmap.PAGESIZE, len(self.map))


def _string(m: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = _LENGTH.unpack_from(m, pos)
    return m[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"), pos + 8 + n


def _value(m: mmap.mmap, pos: int, kind: int):
    if kind == STRING:
        return _string(m, pos)
    if kind == ARRAY:
        inner, n = struct.unpack_from("<IQ", m, pos)
        pos += 12
        if inner in SCALARS:  # (numbers in bulk)
            size = struct.calcsize(SCALARS[inner])
            return np.frombuffer(m, dtype=np.dtype(SCALARS[inner]), count=n, offset=pos), pos + n * size
        if inner == STRING:  # (a vocabulary and its merges: 100k-400k strings, only walked here)
            start = pos
            for _ in range(n):
                pos += 8 + _LENGTH.unpack_from(m, pos)[0]
            return Strings(m, start, n, pos), pos
        items = []
        for _ in range(n):
            item, pos = _value(m, pos, inner)
            items.append(item)
        return items, pos
    if kind not in SCALARS:
        raise ValueError(f"metadata value of type {kind}")
    return struct.unpack_from(SCALARS[kind], m, pos)[0], pos + struct.calcsize(SCALARS[kind])


class Strings:
    """A metadata array of strings, read when asked (the tokenizer's: a load never reads them; a 49k-token vocabulary
    decodes in 18 ms, is walked in 4): its strings' bytes (`encoded`), `tobytes` the array's bytes as stored."""

    def __init__(self, m: mmap.mmap, start: int, n: int, stop: int) -> None:
        self.m, self.start, self.n, self.stop = m, start, n, stop

    def __len__(self) -> int:
        return self.n

    def encoded(self) -> list[bytes]:
        out, pos = [], self.start
        for _ in range(self.n):
            (size,) = _LENGTH.unpack_from(self.m, pos)
            out.append(self.m[pos + 8 : pos + 8 + size])
            pos += 8 + size
        return out

    def tobytes(self) -> bytes:
        return self.m[self.start : self.stop]


def _checkpoint_names(arch: str, blocks: int, wanted: set[str] | None) -> dict[str, str]:
    """GGUF tensor name -> the checkpoint name in `wanted` that gguf-py's map gives it (none: kept as is)."""
    kinds = {name: kind for kind, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in kinds or not wanted:
        return {}
    table = gguf.get_tensor_name_map(kinds[arch], blocks)
    names = {}
    for hf in wanted:  # (a MoE layer's experts, stacked in the file as in the model: [experts, out, in] each)
        m = _EXPERTS.match(hf)
        if m:
            names[f"blk.{m[1]}.ffn_{m[2]}_exps.weight"] = hf
    for hf, (_, name) in table.mapping.items():
        for suffix in (".weight", ".bias"):
            if hf + suffix in wanted:
                names.setdefault(name + suffix, hf + suffix)
    return names


def _field(value) -> SimpleNamespace:
    """A metadata value as a GGUFReader field: strings as their bytes, numbers as rows of one; a type that says which
    (transformers' `_gguf_parse_value` tells integers, floats, booleans and strings apart, no more)."""
    if isinstance(value, Strings):
        return SimpleNamespace(parts=value.encoded(), data=range(len(value)), types=[ARRAY, STRING])
    many = isinstance(value, (list, np.ndarray))
    items = value if many else [value]
    if not len(items) or isinstance(items[0], str):
        kind, parts = STRING, [v.encode() for v in items]
    else:
        numbers = np.asarray(items)
        kind, parts = {"b": 7, "f": 6}.get(numbers.dtype.kind, 4), numbers.reshape(-1, 1)
    return SimpleNamespace(parts=parts, data=range(len(parts)), types=[ARRAY, kind] if many else [kind])
