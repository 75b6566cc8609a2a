"""Reading their JSON files: an unreadable or malformed one is refused in one line naming the flag."""

from __future__ import annotations

import json
from pathlib import Path


def read_json(flag: str, path: str, error=ValueError):
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise error(f"{flag} {path}: cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise error(f"{flag} {path}: not JSON ({exc})") from None
