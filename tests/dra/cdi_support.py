"""The CDI JSON schema (tests/data/cdi/spec.schema.json, written from the CDI SPEC.md) as a checker
for every spec file the DRA tests see."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "data" / "cdi" / "spec.schema.json"


@cache
def _validator() -> Any:
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def schema_errors(spec: object) -> list[str]:
    """What the CDI schema finds wrong with `spec`, one line each (empty: valid)."""
    errors = _validator().iter_errors(spec)
    return [f"{'/'.join(map(str, e.absolute_path)) or '<top>'}: {e.message}" for e in errors]


def assert_valid_spec(spec: object) -> None:
    errors = schema_errors(spec)
    assert not errors, "CDI spec does not validate:\n" + "\n".join(errors)


def load_valid_spec(path: Path) -> dict[str, Any]:
    """The spec file at `path`, checked against the schema."""
    spec = json.loads(path.read_text())
    assert_valid_spec(spec)
    assert isinstance(spec, dict)
    return spec
