"""gin at the edge: registers the library's config classes and parses experiment files.

Library packages never import gin. Entry points in tools/ call `parse(...)` and then construct
configs (e.g. `ModelConfig()`), which picks up the bindings of the parsed files.
"""

from __future__ import annotations

import os
from typing import Sequence

import gin

from moe.config import ModelConfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The gin-wrapped constructor: calling it applies the parsed bindings.
GinModelConfig = gin.external_configurable(ModelConfig, module="moe")


class ConfigError(ValueError):
  """A gin file or binding is unknown, malformed or inconsistent."""


def parse(gin_files: Sequence[str] = (), bindings: Sequence[str] = (), *,
          finalize: bool = True) -> None:
  """Clears gin and parses `gin_files` (paths relative to the repo root work) then `bindings`."""
  gin.clear_config()
  paths = []
  for f in gin_files:
    p = f if os.path.isabs(f) or os.path.exists(f) else os.path.join(REPO_ROOT, f)
    if not os.path.exists(p):
      raise ConfigError(f"gin file not found: {f}")
    paths.append(p)
  gin.add_config_file_search_path(REPO_ROOT)
  try:
    gin.parse_config_files_and_bindings(paths, list(bindings), finalize_config=finalize)
  except (ValueError, KeyError, SyntaxError, TypeError) as e:
    raise ConfigError(f"bad gin config: {e}") from e


def model_config() -> ModelConfig:
  """The ModelConfig bound by the parsed gin files."""
  try:
    return GinModelConfig()
  except (ValueError, TypeError) as e:
    raise ConfigError(str(e)) from e
