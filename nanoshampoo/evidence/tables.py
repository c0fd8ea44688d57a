"""Plain-text tables with left-aligned columns, for terminal reports.

Example:
    >>> print("\\n".join(format_table([["name", "n"], ["adam", "10"]])))
    name  n
    adam  10
"""

from __future__ import annotations


def format_table(rows: list[list[str]]) -> list[str]:
    """Lines of ``rows`` (the first is the header) with every column padded to its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
