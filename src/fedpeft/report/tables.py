"""Tables that fit the terminal's width whole (issue 61).

rich shrinks a table that is too wide by cutting its widest wrappable column down,
to nothing if need be, and then every other column ("train…"), and it folds a long
word at any character ("default-fedl" / "r"). :func:`fit_tables` lays a table out
itself instead: a name column (a run's or a method's name, a grid point) breaks only
after a ``-``, a ``_`` or a space; a number is never broken or cut; a header breaks
only at a space; and the columns that do not fit side by side at all go to a second
table under the first, which repeats the name columns. The breaks are real line
ends between the pieces of a name: no invisible characters are added, so a name
copied from the table (or read from a log file) holds only its own characters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

#: A name's unbreakable pieces: each runs up to and including a ``-``, ``_`` or space(s).
_PIECE = re.compile(r"[^\s_-]*(?:[_-]+\s*|\s+)|[^\s_-]+")


@dataclass(frozen=True)
class Column:
    """One column: ``name`` columns may break after ``-``, ``_`` or a space; the others
    (numbers, short codes) stay whole on one line."""

    header: str
    name: bool = False
    justify: str = "right"


def name_pieces(text: str) -> list[str]:
    """``text``'s pieces, each ending at a place it may break (after ``-``, ``_`` or a space)."""
    return _PIECE.findall(text) or [""]


def _pack(pieces: list[str], width: int) -> list[str]:
    """Pieces onto lines of at most ``width`` cells, greedily; a line's trailing spaces go.
    A piece wider than ``width`` alone is folded (only where no layout gives it room)."""
    lines: list[str] = []
    line = ""
    for piece in pieces:
        if line and cell_len((line + piece).rstrip()) > width:
            lines.append(line.rstrip())
            line = ""
        line += piece
        while cell_len(line.rstrip()) > width > 0:  # a piece wider than the column: folded
            cut = _cut(line, width)
            lines.append(line[:cut])
            line = line[cut:]
    lines.append(line.rstrip())
    return lines


def _cut(text: str, width: int) -> int:
    """The most characters of ``text`` that fit ``width`` cells (at least one)."""
    total = 0
    for i, char in enumerate(text):
        total += cell_len(char)
        if total > width:
            return max(i, 1)
    return len(text)


def break_name(text: str, width: int) -> str:
    """``text`` on lines of at most ``width`` cells, broken only after ``-``, ``_`` or a space."""
    return "\n".join(line for part in text.split("\n") for line in _pack(name_pieces(part), width))


def break_header(text: str, width: int) -> str:
    """A header on lines of at most ``width`` cells, broken only at its spaces."""
    return "\n".join(_pack(re.findall(r"\S+\s*", text) or [""], width))


def _widest(lines: list[str]) -> int:
    return max((cell_len(line) for line in lines), default=0)


def _measures(column: Column, cells: list[str]) -> tuple[int, int]:
    """(narrowest, natural) width of a column: the narrowest keeps every number, header
    word and name piece whole; the natural one has every cell on one line."""
    header_words = _widest(text.rstrip() for text in re.findall(r"\S+\s*", column.header))
    lines = [line for cell in cells for line in cell.split("\n")]
    natural = max(cell_len(column.header), _widest(lines))
    if column.name:
        pieces = (piece.rstrip() for line in lines for piece in name_pieces(line))
        return max(header_words, _widest(list(pieces)), 1), max(natural, 1)
    return max(header_words, _widest(lines), 1), max(natural, 1)


def _table(style: dict, title: str | None, columns: list[Column], widths: list[int]) -> Table:
    table = Table(title=title, **style)
    for column, width in zip(columns, widths, strict=True):
        header = Text(break_header(column.header, width))
        # fold (never crop) in the one case no layout fits: a piece wider than a whole table
        table.add_column(header, justify=column.justify, width=width, overflow="fold")
    return table


def _width(style: dict, widths: list[int]) -> int:
    """The cells a table of this style with columns of these widths takes."""
    probe = _table(style, None, [Column("")] * len(widths), widths)
    console = Console(width=10_000)
    return Measurement.get(console, console.options, probe).maximum


def _fit(
    style: dict, narrow: list[int], natural: list[int], names: list[bool], room: int
) -> list[int] | None:
    """Column widths within ``room`` cells, each between its narrowest and natural width:
    the room left over goes to the names first (fewer lines a row), then the headers
    (fewer header lines). None: even the narrowest widths do not fit."""
    widths = list(narrow)
    spare = room - _width(style, widths)
    if spare < 0:
        return None
    for wanted in (True, False):
        for i, is_name in enumerate(names):
            if is_name == wanted:
                grow = min(spare, natural[i] - widths[i])
                widths[i] += grow
                spare -= grow
    return widths


def _split(others: list[int], fitted, natural) -> list[list[int]]:
    """The non-name columns in order over the fewest tables that fit (``fitted`` is not
    None), the columns spread evenly: of the splits into that many tables, the one whose
    widest table is narrowest (a lone column under a full table reads badly)."""
    from itertools import combinations, pairwise

    count = 1  # how many tables: greedily, each as full as it fits
    group: list[int] = []
    for i in others:
        if group and fitted([*group, i]) is None:
            count, group = count + 1, []
        group.append(i)
    best, best_width = None, None
    for cuts in combinations(range(1, len(others)), count - 1):
        bounds = [0, *cuts, len(others)]
        groups = [others[a:b] for a, b in pairwise(bounds)]
        if any(fitted(g) is None for g in groups):
            continue
        widest = max(sum(natural[i] for i in g) for g in groups)
        if best_width is None or widest < best_width:
            best, best_width = groups, widest
    if best is None:  # a column too wide for any table: as the greedy pass put them
        best = []
        for i in others:
            if not best or fitted([*best[-1], i]) is None:
                best.append([])
            best[-1].append(i)
    return best or [[]]


def fit_tables(
    title: str | None, columns: list[Column], rows: list[list[str]], width: int, **style
) -> list[Table]:
    """``rows`` under ``columns`` as rich tables (``style``: ``Table``'s own options) that
    fit ``width`` cells: one table where the columns fit side by side (names broken after
    ``-``/``_``/spaces, headers at spaces, where needed); else the columns in order over
    as many tables as it takes, each repeating the name columns, the title over the first."""
    cells = [[row[i] for row in rows] for i in range(len(columns))]
    narrow, natural = zip(*(_measures(c, cs) for c, cs in zip(columns, cells, strict=True)), strict=True)
    names = [i for i, c in enumerate(columns) if c.name]
    others = [i for i, c in enumerate(columns) if not c.name]

    def fitted(group: list[int]) -> list[int] | None:
        keep = sorted({*names, *group})
        return _fit(style, [narrow[i] for i in keep], [natural[i] for i in keep],
                    [columns[i].name for i in keep], width)  # fmt: skip

    groups = _split(others, fitted, natural)
    tables = []
    for k, group in enumerate(groups):
        keep = sorted({*names, *group})
        widths = fitted(group) or [narrow[i] for i in keep]  # nothing fits: the narrowest, folded
        table = _table(style, title if k == 0 else None, [columns[i] for i in keep], widths)
        for row in rows:
            table.add_row(
                *(
                    Text(break_name(row[i], w) if columns[i].name else row[i])
                    for i, w in zip(keep, widths, strict=True)
                )
            )
        tables.append(table)
    return tables
