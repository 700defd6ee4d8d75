"""The one error type of Hugging Face checkpoint conversion.

A `CheckpointError` is a `ValueError` whose message names the file (and tensor) at fault. Loading
raises it while validating, before any parameter data is read, so nothing is ever half-loaded.
"""


class CheckpointError(ValueError):
  """A checkpoint that cannot be read or written: unknown architecture, missing or misshapen
  tensor, unsupported dtype or config field, unreadable or corrupt file."""
