"""/etc/nvidia-container-runtime/config.toml: only the keys the agent's config asks for, the rest kept.

The toolkit's package ships the file and an admin may edit it, so the agent owns keys, not the file. What
each key held before the agent first set it is kept in RECORD (a file the agent owns, like the ledger):
a key the config stops naming goes back to that value, or goes if it was not there, and the record
forgets it. Every other byte of the file stays as it is.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from gpu_agent.errors import StageError
from gpu_agent.toolkit.document import ANY, TABLE
from gpu_agent.toolkit.tomldoc import load, without_bom

PATH = "/etc/nvidia-container-runtime/config.toml"
RECORD = "/var/lib/gpu-agent/runtime-config-keys.json"

# dotted key -> what it held before the agent set it: {"value": V}, or {} when it was not there
Record = dict[str, dict[str, Any]]


def read_record(text: Optional[str], name: str = RECORD) -> Record:
    """The record's keys; a record that is not one the agent wrote is an error naming it (and what to do)."""
    if text is None:
        return {}
    try:
        record = json.loads(text)
    except (ValueError, RecursionError):
        record = None
    if not isinstance(record, dict) or not all(isinstance(key, str) and isinstance(was, dict) and set(was) <= {"value"}
                                               for key, was in record.items()):
        raise StageError(f"{name}: not the record of runtime config keys the agent writes; remove it and the "
                         f"keys it set in {PATH} stay as they are")
    return record


def write_record(record: Record) -> Optional[str]:
    """The record's text; None when it holds no key (the file goes)."""
    if not record:
        return None
    try:
        return json.dumps(record, indent=2, sort_keys=True) + "\n"
    except (TypeError, ValueError):  # a date or time TOML value: JSON has none
        raise StageError(f"toolkit.runtime_config: a key the agent would set holds a date or time in {PATH}; "
                         "set it by hand instead") from None


def desired(current: Optional[str], settings: dict[str, Any], record: Record,
            name: str = PATH) -> tuple[Optional[str], Record]:
    """The file with `settings` (dotted keys such as nvidia-container-runtime.mode) set and the keys in `record`
    that `settings` no longer names put back; and the record after. (None, {}) when there is nothing to do."""
    if not settings and not record:
        return None, {}
    import tomlkit

    checked = load(current, name) if current is not None else None  # a clear error for a broken file
    document = tomlkit.parse(without_bom(current or ""))
    after: Record = {}
    for dotted in sorted(record):
        if dotted not in settings:
            _put_back(document, dotted.split("."), record[dotted])
    for dotted, value in sorted(settings.items()):
        *parents, key = dotted.split(".")
        if checked is not None:
            for depth in range(1, len(parents) + 1):
                checked.get(parents[:depth], TABLE)
        if dotted in record:
            after[dotted] = record[dotted]
        else:
            was = checked.get([*parents, key], ANY) if checked is not None else None
            after[dotted] = {} if was is None else {"value": was}
        table = _table(document, parents)
        if table.get(key) != value:
            try:
                table[key] = value
            except (tomlkit.exceptions.ConvertError, TypeError, ValueError):
                raise StageError(f"toolkit.runtime_config: {dotted}: a value TOML cannot hold "
                                 f"({type(value).__name__}); {name} was not changed") from None
    return tomlkit.dumps(document), after


def _table(document: Any, parents: list[str]) -> Any:
    import tomlkit

    table = document
    for parent in parents:
        if parent not in table:
            table[parent] = tomlkit.table()
        table = table[parent]
    return table


def _put_back(document: Any, path: list[str], was: dict[str, Any]) -> None:
    """The key as it was before the agent set it: its old value, or gone (and the tables the agent made
    for it with it, when nothing else is in them)."""
    *parents, key = path
    tables = [document]
    for parent in parents:
        table = tables[-1].get(parent)
        if not isinstance(table, dict):
            return  # someone removed the table since: nothing of ours is left there
        tables.append(table)
    if "value" in was:
        tables[-1][key] = was["value"]
        return
    tables[-1].pop(key, None)
    for depth in range(len(parents), 0, -1):
        if len(tables[depth]) == 0:
            tables[depth - 1].pop(parents[depth - 1], None)
