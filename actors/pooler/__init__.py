"""A pooling model's engine (issue 52): actors/pooler/actor.py. Imports actors/runtime, gpu/ and messages/."""
