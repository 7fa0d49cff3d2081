"""`%nitro_stats`, `%nitro_reset`, `%nitro_panel`, and the plain function behind the stats table.

`stats_table()` works without IPython (scripts, tests, a terminal); only `make_magics_class()` imports
IPython, so importing this module never pulls it in.
"""

import html
from typing import NamedTuple

from . import _cache

_SHAPES_TEXT_WIDTH = 56  # a terminal table stays readable; the HTML table shows shapes in full
_SUMMARIZED = ("params", "grads", "opt_state")  # arguments the handle passes (names from `_handle.py`)

STATS_OPTIONS = ("--reset",)
_BAD_OPTION = "`%{magic}`: {problem}. Valid options: {valid}."


class StatsRow(NamedTuple):
    """One compiled program, as `%nitro_stats` shows it."""

    kind: str
    hooks: str
    shapes: str  # every traced array's shape (the HTML table)
    short_shapes: str  # the same, large arguments summarized (the text table)
    trace_s: float
    compile_s: float
    hits: int
    state: str  # "live", or "poisoned (<what drifted>)"
    why: str  # why it was compiled next to a similar entry, or ""


class StatsTable:
    """The compile cache at one moment: counters, one row per program, and the values nothing tracks.

    Displays as an HTML table in a notebook (`_repr_html_`) and as aligned text elsewhere (`repr`).
    """

    def __init__(self, stats: _cache.CacheStats, rows: list, untracked: list, poisoned: int):
        self.stats = stats
        self.rows = rows
        self.untracked = untracked
        self.poisoned = poisoned

    def summary(self) -> str:
        hits, misses, entries = self.stats
        return f"nitro_ipy cache: hits {hits} | misses {misses} | entries {entries} | poisoned {self.poisoned}"

    def __repr__(self) -> str:
        lines = [self.summary()]
        if self.rows:
            header = ("kind", "hooks", "argument shapes", "trace s", "compile s", "hits", "state")
            cells = [
                (r.kind, r.hooks, _clip(r.short_shapes, _SHAPES_TEXT_WIDTH), f"{r.trace_s:.2f}", f"{r.compile_s:.2f}",
                 str(r.hits), r.state)
                for r in self.rows
            ]
            widths = [max(len(row[i]) for row in (header, *cells)) for i in range(len(header))]
            numeric = {3, 4, 5}  # right-aligned, so the decimal points line up
            for row in (header, *cells):
                lines.append("  ".join(
                    c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
                ).rstrip())
            lines.extend(f"  why {r.kind} compiled: {r.why}" for r in self.rows if r.why)
        else:
            lines.append("(no compiled programs)")
        if self.untracked:
            lines.append("not tracked (an edit to these is invisible; `nitro_ipy.cache_reset()` is the escape "
                         "hatch): " + ", ".join(self.untracked))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        esc = html.escape
        out = [f"<div class='nitro-stats'><p><b>{esc(self.summary())}</b></p>"]
        if self.rows:
            out.append("<table><thead><tr>")
            for h in ("kind", "hooks", "argument shapes", "trace s", "compile s", "hits", "state", "why compiled"):
                out.append(f"<th>{h}</th>")
            out.append("</tr></thead><tbody>")
            for r in self.rows:
                color = "" if r.state == "live" else " style='color:#c77700'"
                out.append(
                    f"<tr><td><code>{esc(r.kind)}</code></td><td>{esc(r.hooks)}</td>"
                    f"<td><code>{esc(r.shapes)}</code></td><td>{r.trace_s:.2f}</td><td>{r.compile_s:.2f}</td>"
                    f"<td>{r.hits}</td><td{color}>{esc(r.state)}</td><td>{esc(r.why)}</td></tr>"
                )
            out.append("</tbody></table>")
        else:
            out.append("<p>(no compiled programs)</p>")
        if self.untracked:
            out.append("<p><b>not tracked</b> (an edit to these is invisible; <code>nitro_ipy.cache_reset()</code> "
                       "is the escape hatch): " + ", ".join(f"<code>{esc(u)}</code>" for u in self.untracked)
                       + "</p>")
        out.append("</div>")
        return "".join(out)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def compact_shapes(entry) -> str:
    """`entry.shapes()` for a terminal: parameters, gradients and optimizer state summarized by their
    array count, so the batch shapes (what usually moves a key) stay in view."""
    groups: dict = {}
    for sig in entry.key.args[1]:
        groups.setdefault((sig.path or "arg").split("[")[0], []).append(sig)
    parts = []
    for name, sigs in groups.items():
        if name in _SUMMARIZED:
            parts.append(f"{name}: {len(sigs)} array{'s' if len(sigs) != 1 else ''}")
        else:  # scalars (Device fields, counts) left out, as in `Entry.shapes()`
            parts.extend(f"{s.path or 'arg'}{list(s.shape)}" for s in sigs if s.shape)
    return ", ".join(parts)


def _state(entry) -> str:
    if not entry.poisoned:
        return "live"
    return f"poisoned ({', '.join(entry.drifted)})" if entry.drifted else "poisoned"


def stats_table() -> StatsTable:
    """The compile cache as a table: what `%nitro_stats` shows, usable without IPython.

    Re-resolves dependency closures first (`_cache.ensure_fresh()`, a no-op when nothing was redefined),
    so a program compiled against code edited since shows as poisoned rather than live.
    """
    _cache.ensure_fresh()
    entries = _cache.live_entries() + _cache.poisoned_entries()
    rows, untracked = [], []
    for e in entries:
        rows.append(StatsRow(e.kind, ", ".join(e.hook_names), e.shapes(), compact_shapes(e), e.trace_s,
                             e.compile_s, e.hits, _state(e), e.why or ""))
        for item in getattr(e.closure, "untracked", None) or ():
            text = str(item)
            if text not in untracked:
                untracked.append(text)
    return StatsTable(_cache.cache_stats(), rows, untracked, len(_cache.poisoned_entries()))


def make_magics_class():
    """The IPython `Magics` subclass, built on demand so this module imports without IPython."""
    from IPython.core.error import UsageError
    from IPython.core.magic import Magics, line_magic, magics_class
    from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

    def parse(magic, line: str, name: str, valid: tuple):
        try:
            return parse_argstring(magic, line)
        except UsageError as err:
            raise UsageError(_BAD_OPTION.format(magic=name, problem=err, valid=", ".join(valid))) from None

    def no_arguments(line: str, name: str):
        if line.strip():
            raise UsageError(_BAD_OPTION.format(magic=name, problem=f"unexpected `{line.strip()}`", valid="none"))

    @magics_class
    class NitroMagics(Magics):
        """nitro_ipy's magics: thin wrappers over `stats_table()`, `cache_reset()` and the live panel."""

        @magic_arguments()
        @argument("--reset", action="store_true", help="empty the compile cache and zero its counters")
        @line_magic
        def nitro_stats(self, line=""):
            """Show the compile cache: hits, misses, entries, and one row per compiled program.

            `%nitro_stats --reset` empties the cache instead (the escape hatch for an edit nothing tracks).
            """
            args = parse(self.nitro_stats, line, "nitro_stats", STATS_OPTIONS)
            if args.reset:
                return _reset()
            return stats_table()

        @line_magic
        def nitro_reset(self, line=""):
            """Empty the compile cache and zero its counters (`nitro_ipy.cache_reset()`)."""
            no_arguments(line, "nitro_reset")
            return _reset()

        @line_magic
        def nitro_panel(self, line=""):
            """Show the live panel: hits, misses, entries and the latest compile, updating while training."""
            no_arguments(line, "nitro_panel")
            from . import _extension

            _extension.show_panel(self.shell)

    return NitroMagics


def _reset() -> None:
    from . import cache_reset

    cache_reset()
    print("nitro_ipy: compile cache emptied; counters zeroed.")
