"""`RecordingParams`: a read-only view of `Params` that records every params key the code reads.

Reading a field records its dotted key (`rollout.temperature`); a nested section is returned as a view
of its own, so only the leaves actually read are recorded. Methods and properties run with the view as
`self`, so what they read is recorded too (`resolved_verifier()` records `reward.verifier`,
`data.source`, `data.task`). One rule is semantic rather than mechanical: the resolved algorithm
(`algorithm.resolve()`) records, for each component read, `algorithm.<component>` and
`algorithm.preset`, since a component is the preset's value unless its own key overrides it.
"""

from __future__ import annotations

import inspect
from types import FunctionType

from pydantic import BaseModel

from rlpipe.config import AlgorithmConfig


class RecordingParams:
    def __init__(self, model: BaseModel, sink: set[str], prefix: str = "", also: tuple[str, ...] = ()):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_sink", sink)
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "_also", also)  # keys recorded with every leaf read (algorithm.preset)

    def __getattr__(self, name: str):
        model, sink, prefix, also = (object.__getattribute__(self, k) for k in ("_model", "_sink", "_prefix", "_also"))
        cls = type(model)
        if name in cls.model_fields:
            value = getattr(model, name)
            if isinstance(value, BaseModel):
                return RecordingParams(value, sink, f"{prefix}{name}.", also)
            sink.update({f"{prefix}{name}", *also})
            return value
        static = inspect.getattr_static(cls, name)
        if isinstance(model, AlgorithmConfig) and name == "resolve":
            return lambda: RecordingParams(model.resolve(), sink, prefix, also=(f"{prefix}preset",))
        if isinstance(static, property):
            return static.fget(self)
        if isinstance(static, FunctionType):
            return static.__get__(self)
        return getattr(model, name)

    def __iter__(self):
        for name in type(object.__getattribute__(self, "_model")).model_fields:
            yield name, getattr(self, name)

    def __setattr__(self, name, value):
        raise AttributeError("params are read-only")

    def __repr__(self) -> str:
        return f"RecordingParams({object.__getattribute__(self, '_model')!r})"


def covered(key: str, declared: list[str]) -> bool:
    """Whether DVC's params entries `declared` cover `key` (an entry covers itself and every key below)."""
    return any(key == d or key.startswith(d + ".") for d in declared)
