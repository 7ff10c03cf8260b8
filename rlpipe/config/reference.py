"""docs/params.md, generated from the params models: every key, its type, its default and its docstring.

`rlpipe params-reference` writes it; tests/test_config.py keeps it current.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from rlpipe.config.params import Params
from rlpipe.config.sections import AlgorithmConfig, ResolvedAlgorithm

HEADER = """# Parameter reference

Every key of `params.yaml`, generated from the pydantic models in `rlpipe/config/` by
`rlpipe params-reference` (a test keeps this page current). A key left out of `params.yaml` takes the
default shown here; `rlpipe/config/` holds every default and nothing else does. An unknown key is
rejected before any stage works, naming the nearest valid key.

The `algorithm` section is a preset plus an override for each of its components: `null` keeps the
preset's value (docs/algorithms.md gives each preset's components and each component's formula).
"""


def type_name(annotation: Any) -> str:
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args if a is not type(None)) + (" or null" if type(None) in args else "")
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (list, dict):
        return f"{origin.__name__} of " + ", ".join(type_name(a) for a in args)
    return getattr(annotation, "__name__", str(annotation))


def default_text(field) -> str:
    if field.default is PydanticUndefined:
        value = field.default_factory() if field.default_factory else None
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return "`null`" if value is None else f"`{value}`"


def describe(field) -> str:
    return " ".join((field.description or "").split()).replace("|", "\\|")


def section_rows(model: type[BaseModel], prefix: str) -> tuple[list[str], list[tuple[str, type[BaseModel]]]]:
    rows, nested = [], []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            nested.append((f"{prefix}{name}", annotation))
            continue
        rows.append(f"| `{prefix}{name}` | {type_name(annotation)} | {default_text(field)} | {describe(field)} |")
    return rows, nested


def render_reference() -> str:
    out = [HEADER]
    top_rows, sections = section_rows(Params, "")
    out += ["## Top level", "", "| key | type | default | meaning |", "|---|---|---|---|", *top_rows, ""]
    todo = list(sections)
    while todo:
        name, model = todo.pop(0)
        rows, nested = section_rows(model, f"{name}.")
        summary = describe(Params.model_fields[name]) if name in Params.model_fields else (model.__doc__ or "").strip()
        out += [f"## `{name}`", "", " ".join(summary.split()), "", "| key | type | default | meaning |",
                "|---|---|---|---|", *rows, ""]
        if model is AlgorithmConfig:
            out += ["Each override's type and bounds are those of the component (`null` = the preset's value); "
                    "the components' own defaults, which a preset departs from:", "",
                    "| component | default |", "|---|---|",
                    *(f"| `{k}` | {default_text(f)} |" for k, f in ResolvedAlgorithm.model_fields.items()), ""]
        todo = nested + todo
    return "\n".join(out).rstrip() + "\n"
