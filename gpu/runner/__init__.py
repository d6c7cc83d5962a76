"""The model runner: one step from a BatchSpec to logits (model_runner.py), decode graphs on static buffers
(graphs.py), the memory plan that sizes the KV cache (memory.py), the native layer loop (native_loop.py). view.py is
what graphs and memory read of the runner. The top of gpu/ (rank 6): imports anything below, and only the worker
(actors/engine) imports it."""
