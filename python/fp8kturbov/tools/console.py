"""Text for the terminal, shared by the commands: numbers and aligned tables, and progress on
stderr."""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterator, Sequence

#: Binary units of the sizes the tools parse and print.
MiB = 1 << 20
GiB = 1 << 30


def format_number(value: float | None, digits: int = 1) -> str:
    """``value`` with ``digits`` decimals; ``"-"`` for None (not measured)."""
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(cells: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """Plain-text columns: text left-aligned, numbers right-aligned."""
    widths = [max(len(str(c)) for c in column) for column in zip(header, *cells)]
    numeric = [all(_is_number(row[i]) for row in cells) and bool(cells) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w)
                         for c, w, num in zip(row, widths, numeric)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, cells)])


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return text == "-"
    return True


def progress(items: Sequence[Any], label: Callable[[Any], str], enabled: bool = True) -> Iterator[Any]:
    """Yield ``items`` while showing progress on stderr: a tqdm bar if tqdm is importable, else
    one ``[i/n] label`` line per item."""
    if not enabled:
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:
        for i, item in enumerate(items, 1):
            print(f"[{i}/{len(items)}] {label(item)}", file=sys.stderr, flush=True)
            yield item
        return
    with tqdm(items, file=sys.stderr, unit="case", leave=False) as bar:
        for item in bar:
            bar.set_postfix_str(label(item))
            yield item
