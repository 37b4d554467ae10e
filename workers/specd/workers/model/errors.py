"""The error every model-loading check raises: config parsing, quantization, tensors.

Its own module so that the parsers ``config.py`` calls (``quantization.py``) can raise
it without importing ``config.py`` back.
"""


class ModelLoadError(ValueError):
    """A model folder cannot be loaded; the message names the file, tensor or setting."""
