"""From files to a served model: config.py (config.json parsed and checked into a ModelConfig), weights.py (the
checkpoint's tensors into a family's model, sharded and quantized as served), mapped.py and gguf_file.py (safetensors
and GGUF files read in place), gguf_card.py (a .gguf's config and tokenizer, made once into the cache), convert.py
(the bundled SmolLM2 fetched and converted once into the cache; `python -m gpu.loading.convert`), errors.py. Imports
gpu/models and everything below it (rank 5); the runner, the gang and the front's launch import it."""
