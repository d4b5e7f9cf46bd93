"""Config variants: one implementation's default config for each call with some fields
replaced, checked and timed as a column of its own beside the default, in the same rounds.

`--variant mosaic:ovl:fwd_intra_wg_overlap=True,fwd_q_registers=True` adds the column
"mosaic:ovl": for every (shape, mode, causal) the config `implementation="mosaic"` would take
for that call (the full call's: a check on a leading slice runs it too), with those fields
replaced. Values are Python literals. So one run decides whether a tuning change pays.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from typing import Any

from pallas_flash import backends, validation
from pallas_flash.bench.shapes import ShapeSpec, kv_struct, shape_struct

# The implementations that take a config (backends.Backend.config_type).
CONFIGURED = tuple(n for n in backends.IMPLEMENTATIONS if n != "reference")
_USAGE = "IMPL:LABEL:FIELD=VALUE[,FIELD=VALUE...]"


@dataclasses.dataclass(frozen=True)
class Variant:
  """An implementation (one of CONFIGURED) run with config fields replaced."""

  impl: str
  label: str
  fields: tuple[tuple[str, Any], ...]

  @property
  def name(self) -> str:
    return f"{self.impl}:{self.label}"

  def config(self, spec: ShapeSpec, dtype, *, is_causal: bool):
    """The config `implementation=self.impl` takes for the call, with `fields` replaced."""
    s, kv = shape_struct(spec, dtype), kv_struct(spec, dtype)
    info = validation.abstract_call_info(s, kv, kv,
                                         validation.with_defaults({"is_causal": is_causal}))
    return dataclasses.replace(backends.resolve_config(self.impl, info, None),
                               **dict(self.fields))


def parse(text: str, config_types: dict[str, type] | None = None,
          call_fields: tuple[str, ...] = ()) -> Variant:
  """`IMPL:LABEL:FIELD=VALUE[,FIELD=VALUE...]` -> Variant; SystemExit naming what is wrong.
  config_types: {IMPL: its config class} where IMPL is not flash_attention's (the decode
  benchmark's); by default one of CONFIGURED with its backend's config. call_fields: keyword
  arguments of the call that a variant may set beside the config's fields (the decode
  benchmark's num_splits)."""
  parts = text.split(":", 2)
  if len(parts) != 3 or not parts[1] or not parts[2]:
    raise SystemExit(f"--variant {text!r}: expected {_USAGE}.")
  impl, label, assignments = parts
  allowed = CONFIGURED if config_types is None else tuple(config_types)
  if impl not in allowed:
    raise SystemExit(f"--variant {text!r}: IMPL must be one of {sorted(allowed)}.")
  if config_types is None:
    backend = backends.load(impl)
    if isinstance(backend, str):
      raise SystemExit(f"--variant {text!r}: {backend}")
    config_type = backend.config_type
  else:
    config_type = config_types[impl]
  known = {f.name for f in dataclasses.fields(config_type)} | set(call_fields)
  fields = []
  for item in re.split(r",(?=\s*\w+\s*=)", assignments):  # commas inside tuples stay
    name, eq, value = item.partition("=")
    name = name.strip()
    if not eq or name not in known:
      raise SystemExit(f"--variant {text!r}: {name!r} is not a field of "
                       f"{config_type.__name__} ({', '.join(sorted(known))}).")
    try:
      fields.append((name, ast.literal_eval(value.strip())))
    except (ValueError, SyntaxError):
      raise SystemExit(f"--variant {text!r}: the value of {name} must be a Python literal, "
                       f"got {value.strip()!r}.") from None
  return Variant(impl, label, tuple(fields))
