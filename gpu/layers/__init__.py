"""Building blocks of a decoder-only model: a family's quirk is a parameter of a block, never a copy of it. linear.py
and quant.py (float32 and quantized linear layers), norm.py, rotary.py, mlp.py, moe.py, parallel.py (tensor-parallel
shards), attention.py (the attention block over a backend). Imports gpu/attention, gpu/kernels and gpu/distributed
(rank 3); the families import it."""
