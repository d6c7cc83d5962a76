"""Attention for one step of mixed prefill and decode rows over the paged KV cache: metadata.py (the common tensors and
the torch path's segment plans), kv_cache.py (the cache tensors and their sizes), the backends (torch_backend.py, the
reference; triton_backend.py; native_backend.py) and backend.py (their protocol, and the one choice at load). Imports
gpu/kernels only (rank 2); the layers and the runner import it."""
