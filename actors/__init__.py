"""The actor runtime (actors/runtime) and the actors: engine, detokenizer."""
