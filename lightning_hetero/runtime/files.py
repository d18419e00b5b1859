"""Runtime: file reads that may fail (``/proc`` on another OS, a thread that ended): ``None`` instead of raising."""

from __future__ import annotations

from typing import Optional


def read_text(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return file.read()
    except OSError:
        return None
