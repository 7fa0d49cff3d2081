"""The compile cache as a table: plain data (`StatsTable`, one `StatsRow` per program) with a text and
an HTML renderer. Core code: it works without IPython (scripts, tests, a terminal); `%nitro_stats` only
displays it.
"""

import html
from typing import NamedTuple

from . import _cache, _store

_SHAPES_TEXT_WIDTH = 56  # a terminal table stays readable; the HTML table shows shapes in full
_SUMMARIZED = ("params", "grads", "opt_state")  # arguments the handle passes (names from `_handle.py`)


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

    def __init__(self, stats: _cache.CacheStats, rows: list, untracked: list, poisoned: int, store=None):
        """**Arguments:**

        - `stats`: the cache's counters (hits, misses, entries).
        - `rows`: one `StatsRow` per program, live ones first.
        - `untracked`: the values no closure tracks, as text, each once.
        - `poisoned`: how many entries are poisoned.
        - `store`: the program store's `StoreStats` (directory, count, size), or None.
        """
        self.store = store
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
        if self.store is not None:
            lines.append(repr(self.store))
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
                color = "" if r.state.startswith("live") else " style='color:#c77700'"
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
        if self.store is not None:
            out.append(f"<p>{esc(repr(self.store))}</p>")
        out.append("</div>")
        return "".join(out)


def _clip(text: str, width: int) -> str:
    """`text`, cut to `width` characters with an ellipsis when longer."""
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


def _row_state(entry) -> str:
    if not entry.poisoned:
        return "live, from disk" if entry.origin == "disk" else "live"
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
                             e.compile_s, e.hits, _row_state(e), e.why or ""))
        for item in getattr(e.closure, "untracked", None) or ():
            text = str(item)
            if text not in untracked:
                untracked.append(text)
    store = _store.store_stats()  # said only when the store is on: off is the quiet default of scripts
    return StatsTable(_cache.cache_stats(), rows, untracked, len(_cache.poisoned_entries()),
                      store if store.path is not None else None)
