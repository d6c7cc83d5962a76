"""Device code: model, weights, paged KV cache, attention, model runner (CPU is a valid device)."""
