"""The kernel backends a block can call besides the torch reference (DESIGN.md section 10): Triton kernels, compiled
on a GPU and run by the interpreter on CPU (TRITON_INTERPRET=1). Importing this package imports no kernel module:
each is imported once its backend is chosen, after TRITON_INTERPRET is settled."""
