"""The kernels a block calls (DESIGN.md section 10), one set per backend, each step with the same contract:
reference.py (the torch steps, the reference every other set is tested against), triton/ (compiled on a GPU, run by
the interpreter on CPU with TRITON_INTERPRET=1) and native/ (the C++ extension for CPUs, AVX2 or AVX-512). Imports
torch and the standard library only, nothing else of gpu/ (rank 1). Importing this package imports no kernel module:
each is imported once its backend is chosen (Triton after TRITON_INTERPRET is settled)."""
