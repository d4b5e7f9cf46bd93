"""The implementations and how one is chosen for a call.

Each backend package (`xla`, `triton`, `mosaic_gpu`) provides the contract described in
`pallas_flash.call`: `forward`, `backward`, `unsupported_reason(call, config)`,
`default_config(call)`, `CONFIG_TYPE`, `SUPPORTED_FEATURES` and optionally
`BACKWARD_COMPUTES_DELTA`, `FUSES_SINKS` and `by_name_reason(call)` (calls it runs
only when named: correct, not measured faster than the next choice). This module turns it
into one frozen `Backend` record; the API knows no backend's config fields.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import Any, Literal

from pallas_flash.call import CallInfo

Implementation = Literal["mosaic", "triton", "interpret", "xla", "reference"]
IMPLEMENTATIONS: tuple[str, ...] = ("mosaic", "triton", "interpret", "xla", "reference")
# What `implementation=None` tries, fastest first.
AUTO_ORDER: tuple[str, ...] = ("mosaic", "triton", "xla")

# Module and fixed keyword arguments of each backend; "interpret" runs the Triton kernels in the
# Pallas interpreter.
_MODULES = {
    "mosaic": ("pallas_flash.mosaic_gpu", {}),
    "triton": ("pallas_flash.triton", {"interpret": False}),
    "interpret": ("pallas_flash.triton", {"interpret": True}),
    "xla": ("pallas_flash.xla", {}),
}


@dataclasses.dataclass(frozen=True)
class Backend:
  """One implementation's side of the contract (see pallas_flash.call)."""

  name: str
  forward: Callable
  backward: Callable
  unsupported_reason: Callable[[CallInfo, Any], str | None]
  default_config: Callable[[CallInfo], Any]
  config_type: type
  features: frozenset[str]  # the optional features (call.FEATURES) it implements
  computes_delta: bool = False  # BACKWARD_COMPUTES_DELTA
  fuses_sinks: bool = False  # FUSES_SINKS: its forward adds attention sinks (pallas_flash.call)
  # Other calls it runs only when named (the module's by_name_reason(call)): why, or None.
  by_name_reason: Callable[[CallInfo], str | None] | None = None


@functools.cache
def load(name: str) -> Backend | str:
  """The backend `name`, or the reason it cannot be imported here."""
  module_name, kwargs = _MODULES[name]
  try:
    mod = importlib.import_module(module_name)
  except ImportError as e:  # e.g. a jaxlib built without the Pallas GPU lowerings
    return f"cannot import {module_name}: {e}"
  bind = (lambda f: functools.partial(f, **kwargs)) if kwargs else (lambda f: f)
  return Backend(name, bind(mod.forward), bind(mod.backward), bind(mod.unsupported_reason),
                 mod.default_config, mod.CONFIG_TYPE, frozenset(mod.SUPPORTED_FEATURES),
                 bool(getattr(mod, "BACKWARD_COMPUTES_DELTA", False)),
                 bool(getattr(mod, "FUSES_SINKS", False)),
                 getattr(mod, "by_name_reason", None))


def config_type_reason(name: str, config_type: type, config) -> str | None:
  """Why `config` is not one that implementation `name` takes (None: it is, or is None)."""
  if config is None or isinstance(config, config_type):
    return None
  return f"config is a {type(config).__name__}, but {name!r} takes a {config_type.__name__}"


def reason(name: str, info: CallInfo, config) -> str | None:
  """Why implementation `name` cannot run the call `info` with `config` (None: it can)."""
  if name == "reference":
    return None if config is None else "the reference takes no config"
  backend = load(name)
  if isinstance(backend, str):
    return backend
  if (why := config_type_reason(name, backend.config_type, config)) is not None:
    return why
  missing = info.params.features - backend.features
  if missing:
    return f"{name} does not support {', '.join(sorted(missing))} yet"
  return backend.unsupported_reason(info, config)


def auto_reason(name: str, info: CallInfo, config) -> str | None:
  """`reason`, plus the calls `name` runs only when asked for by name."""
  why = reason(name, info, config)
  if why is None and name != "reference" and not isinstance(backend := load(name), str):
    if backend.by_name_reason is not None:
      why = backend.by_name_reason(info)
  return why


def auto_choice(reasons: dict[str, str | None]) -> str | None:
  """The first implementation of AUTO_ORDER that can run the call, or None."""
  return next((name for name in AUTO_ORDER if reasons[name] is None), None)


def check_implementation(implementation) -> None:
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"Unknown implementation={implementation!r}; choose one of "
                     f"{IMPLEMENTATIONS} or None for automatic.")


def choose(info: CallInfo, implementation: str | None, config) -> str:
  """The implementation to run; raises NotImplementedError with every reason when none can."""
  check_implementation(implementation)
  if implementation is not None:
    why = reason(implementation, info, config)
    if why is not None:
      raise NotImplementedError(f"implementation={implementation!r} cannot run this call: {why}")
    return implementation
  reasons = {name: auto_reason(name, info, config) for name in IMPLEMENTATIONS}
  chosen = auto_choice(reasons)
  if chosen is None:
    raise NotImplementedError("No implementation can run this call:\n" + "\n".join(
        f"  {n}: {r}" for n, r in reasons.items()))
  return chosen


def resolve_config(name: str, info: CallInfo, config):
  """The config `name` runs `info` with: `config` when given, else the backend's default (None
  for the reference). The one place a default config is chosen."""
  if config is not None or name == "reference":
    return config
  return load(name).default_config(info)
