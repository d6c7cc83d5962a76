"""The one error a model that cannot be served raises, from any loading module (config, card, files, weights)."""


class ModelLoadError(Exception):
    """The model directory cannot be served; the message says exactly what is missing or unsupported."""
