"""The detokenizer actor and its per-request logic (incremental decoding, stop strings)."""
