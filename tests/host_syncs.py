"""HostSyncs: the host syncs a block of code makes, recorded on any device (tests/test_graph_capture.py's detector).

On CUDA these wait for the device: an aten op that reads a value back (a tensor's item / bool / int:
_local_scalar_dense) or sizes its output by the data (nonzero, boolean indexing or index_put, masked_select, unique,
bincount, repeat_interleave without output_size, equal); a tensor of one or more dimensions made from host data (on a card,
an upload from pageable memory; a 0-dim one, as Gemma's embedding scale, enters a device op as a scalar, copied
nowhere); and the Tensor methods that copy to the host, which on CPU dispatch
nothing (tolist, numpy, __array__, cpu(), `to` a CPU device). Inside a CUDA graph's capture any of them fails it;
in a step, it stalls async scheduling.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
SYNCS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.bincount.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
}
SIZED_BY_DATA = aten.repeat_interleave.Tensor  # (unless given its output_size)
INDEXED = (aten.index.Tensor, aten.index_put_.default, aten.index_put.default)  # (with a boolean mask: a nonzero)
MADE = aten.lift_fresh.default  # a tensor made from host data (torch.tensor, as_tensor, from_numpy)


HOST_READS = ("tolist", "numpy", "__array__", "cpu", "to")  # (Tensor methods; `to` only to a CPU device)


class HostSyncs(TorchDispatchMode):
    """The host syncs (module docstring) made while it is entered, in `seen`."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self.methods = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def __enter__(self):
        for name, method in self.methods.items():
            setattr(torch.Tensor, name, self.recording(name, method))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self.methods.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def recording(self, name: str, method):
        def read(tensor, *args, **kwargs):
            places = [a for a in (*args, kwargs.get("device")) if isinstance(a, str | torch.device)]  # (not tensors)
            to_host = name != "to" or any(str(a).startswith("cpu") for a in places)
            if to_host:
                self.seen.append(f"Tensor.{name}")
            return method(tensor, *args, **kwargs)

        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        bool_index = func in INDEXED and any(i is not None and i.dtype == torch.bool for i in args[1])
        sized = func is SIZED_BY_DATA and kwargs.get("output_size") is None
        if func in SYNCS or bool_index or sized or (func is MADE and out.dim() > 0):
            self.seen.append(str(func))
        return out
