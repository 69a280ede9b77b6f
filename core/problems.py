"""Every problem of a validation, listed rather than raised one at a time, in words a user
acts on (the key or path, the value, what was expected). Two readers share it: the recipe
(a line per error, `problem_lines`) and the serving config.json (export/serving_config.py,
`validate_listing_problems`: the fields that validated are still read, so a reader reports
every problem of a head at once).
"""

from __future__ import annotations

from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo


def problem_lines(err: ValidationError, prefix: str = "") -> list[str]:
    """One line per error of `err`: "unknown key 'a.b'" for a key the schema does not
    have, else "a.b: message" (the location dotted under `prefix`; "(top)" when empty)."""
    lines = []
    for e in err.errors():
        loc = ".".join([prefix, *(str(p) for p in e["loc"])] if prefix else [str(p) for p in e["loc"]])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{loc}'")
        else:
            lines.append(f"{loc or '(top)'}: {e['msg'].removeprefix('Value error, ')}")
    return lines


def given(model: BaseModel | None, name: str) -> bool:
    """Whether the config wrote `name` (even as null), as opposed to leaving it out."""
    return model is not None and name in model.model_fields_set


def validate_listing_problems(cls: type[BaseModel], raw: dict) -> tuple[Any, list[str], set[str]]:
    """`raw` validated with `cls`, never raising: (the model, with each refused value None
    and the rest validated; a problem per error, naming its path and value in a field's
    `expected` words (`json_schema_extra`) where it has them; the paths refused)."""
    try:
        return cls.model_validate(raw), [], set()
    except ValidationError as err:
        errors = err.errors()
    problems, invalid = [], set()
    for error in errors:
        path, text = _problem(cls, raw, error)
        invalid.add(path)
        if text not in problems:
            problems.append(text)
    return _salvage(cls, raw, [e["loc"] for e in errors]), problems, invalid


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model class inside an annotation (`M`, `M | None`, `list[M]`), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, UnionType, list):
        for arg in get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def _owner(cls: type[BaseModel], loc: tuple) -> tuple[int, FieldInfo | None]:
    """How many parts of an error's location name the field it belongs to, and that
    field: an item of a list of numbers belongs to the list, a union branch to the field."""
    depth, info, model = 0, None, cls
    for i, part in enumerate(loc):
        if isinstance(part, str) and model is not None and part in model.model_fields:
            info = model.model_fields[part]
            depth, model = i + 1, _model_in(info.annotation)
        elif not (isinstance(part, int) and model is not None):
            break
    return depth, info


def _path(loc: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))


def _value_at(raw: Any, loc: tuple) -> Any:
    for part in loc:
        raw = raw[part]
    return raw


def _problem(cls: type[BaseModel], raw: dict, error: dict) -> tuple[str, str]:
    depth, info = _owner(cls, error["loc"])
    loc = error["loc"][:depth]
    path = _path(loc)
    if error["type"] == "missing" and depth == len(error["loc"]):
        hint = f" ({info.description})" if info is not None and info.description else ""
        return path, f"{path} is missing{hint}"
    value = _value_at(raw, loc)
    expected = (info.json_schema_extra or {}).get("expected") if info is not None else None
    if expected:
        return path, f"{path} is {value!r}, expected {expected}"
    msg = error["msg"]
    return path, f"{path} is {value!r}; {msg[0].lower()}{msg[1:]}"


def blank(cls: type[BaseModel]) -> BaseModel:
    """A model with every field None, for a part of the config that is missing or refused."""
    return cls.model_construct(
        **{name: _blank_value(f) for name, f in cls.model_fields.items() if f.is_required()}
    )


def _blank_value(info: FieldInfo) -> Any:
    model = _model_in(info.annotation)
    return blank(model) if model is not None and get_origin(info.annotation) is not list else None


def _salvage(cls: type[BaseModel], raw: Any, bad: list[tuple]) -> BaseModel:
    """The model of `raw` with each refused value None and the rest validated."""
    if not isinstance(raw, dict) or any(not loc for loc in bad):
        return blank(cls)
    values: dict[str, Any] = {}
    for name, info in cls.model_fields.items():
        if name not in raw:
            if info.is_required():
                values[name] = _blank_value(info)
            continue
        here = [loc[1:] for loc in bad if loc[0] == name]
        values[name] = _salvage_value(info, raw[name], here) if here else _valid(info, raw[name])
    return cls.model_construct(**values)


def _salvage_value(info: FieldInfo, value: Any, bad: list[tuple]) -> Any:
    model = _model_in(info.annotation)
    if model is None or any(not loc for loc in bad):
        return _blank_value(info) if info.is_required() else None
    if isinstance(value, list):
        return [
            _salvage(model, item, [loc[1:] for loc in bad if loc[0] == i])
            if any(loc[0] == i for loc in bad)
            else model.model_validate(item)
            for i, item in enumerate(value)
        ]
    return _salvage(model, value, bad)


def _valid(info: FieldInfo, value: Any) -> Any:
    """A value that passed validation, as validation makes it (nested models built)."""
    return TypeAdapter(info.annotation).validate_python(value) if _model_in(info.annotation) else value
