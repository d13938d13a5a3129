"""Shared plumbing of the planning package's JSON files (cost model, compression cost, contention).

Each file is a dict with a ``format`` tag, an integer ``version`` and the object's fields.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence


def check_header(data: Mapping[str, Any], fmt: str, version: int, what: str, required: Sequence[str] = ()) -> None:
    """Check the ``format`` tag, the ``version`` and the presence of ``required`` keys.

    Args:
        data: the parsed JSON object.
        fmt: the expected format tag.
        version: the supported version.
        what: what the file holds, for the messages (``"cost model file"``, ``"contention model"``).
        required: keys that must be present.

    Raises:
        ValueError: naming the format found, the version found and the supported one, or the missing keys.
    """
    if not isinstance(data, Mapping) or data.get("format") != fmt:
        found = data.get("format") if isinstance(data, Mapping) else type(data).__name__
        raise ValueError(f"not a {what}: format is {found!r}, expected {fmt!r}")
    if data.get("version") != version:
        raise ValueError(f"unsupported {what} version {data.get('version')!r}; valid: {version}")
    missing = [k for k in required if k not in data]
    if missing:
        raise ValueError(f"{what} lacks {missing}")


def save_json(obj: Any, path: str | Path) -> Path:
    """Write ``obj.to_dict()`` as indented JSON to ``path``; return the path."""
    p = Path(path)
    p.write_text(json.dumps(obj.to_dict(), indent=2) + "\n")
    return p
