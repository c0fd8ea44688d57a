"""Tables for reports: plain text with left-aligned columns (terminal) and Markdown.

Example:
    >>> print("\\n".join(format_table([["name", "n"], ["adam", "10"]])))
    name  n
    adam  10
    >>> print("\\n".join(format_markdown_table([["name", "n"], ["adam", "10"]])))
    | name | n  |
    |------|----|
    | adam | 10 |
"""

from __future__ import annotations


def format_table(rows: list[list[str]]) -> list[str]:
    """Lines of ``rows`` (the first is the header) with every column padded to its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def format_markdown_table(rows: list[list[str]]) -> list[str]:
    """Lines of a GitHub Markdown table of ``rows`` (the first is the header), padded to line up.

    A ``|`` inside a cell is escaped so that it cannot split the cell.
    """
    cells = [[cell.replace("|", "\\|") for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |"

    return [
        line(cells[0]),
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
        *map(line, cells[1:]),
    ]
