"""Triton kernels (DESIGN.md section 10): attention.py (paged attention over the block tables, split-K for long rows)
and fused.py (the decoder's small steps as one kernel each: the Triton kernel set). Imported only by the triton
attention backend (gpu/attention/triton_backend.py), once chosen."""
