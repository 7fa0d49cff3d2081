"""The compile cache as a table: plain data (`StatsTable`, one `StatsRow` per program) with a text and
an HTML renderer. Core code: it works without IPython (scripts, tests, a terminal); `%nitro_stats` only
displays it.
"""

import html
import math
import re
from typing import NamedTuple

from .._base import _html, _writes
from .._base._report import some, why_summary
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
    why: str  # why it was compiled next to a similar entry (an `_report.Explanation`), or ""
    inputs: str = ""  # the inputs summarised by human names (`summarise_inputs`)
    untracked: tuple = ()  # what it read that has no content fingerprint: edits inside it are invisible
    drifted: tuple = ()  # what an edit moved under it, when poisoned


class StatsTable:
    """The compile cache at one moment: counters, one row per program, and the values nothing tracks.

    Displays as an HTML table in a notebook (`_repr_html_`) and as aligned text elsewhere (`repr`).
    """

    def __init__(self, stats: _cache.CacheStats, rows: list, untracked: list, poisoned: int, store=None,
                 why: bool = False):
        """**Arguments:**

        - `stats`: the cache's counters (hits, misses, entries).
        - `rows`: one `StatsRow` per program, live ones first.
        - `untracked`: the values no closure tracks, as text, each once.
        - `poisoned`: how many entries are poisoned.
        - `store`: the program store's `StoreStats` (directory, count, size), or None.
        - `why`: list every change behind each compile (`%nitro_stats --why`), not their summary.
        """
        self.why = why
        self.store = store
        self.stats = stats
        self.rows = rows
        self.untracked = untracked
        self.poisoned = poisoned
        self.swept = _writes.swept_summary()  # temp and truncated files killed writers left, removed at start

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
            for r in self.rows:
                lines.extend(self._why_lines(r))
            # the flat layout's parameter groups (an optimizer program's gradients), with their sizes
            lines.extend(f"  {r.kind} parameter groups: {m.group(1)}" for r in self.rows
                         if (m := re.search(r"gradients [^;]* in (\d+ groups \([^)]*\))", r.inputs or "")))
        else:
            lines.append("(no compiled programs)")
        if self.untracked:
            lines.append("not tracked (an edit to these is invisible; `nitro_ipy.cache_reset()` is the escape "
                         "hatch): " + ", ".join(self.untracked))
        if self.store is not None:
            lines.append(repr(self.store))
        if self.swept:
            lines.append(self.swept)
        return "\n".join(lines)

    def _why_lines(self, r: StatsRow) -> list[str]:
        """A row's reason: summed up, or with `why` every change (and every edited name) on its own line."""
        out = []
        if r.why:
            summary = why_summary(r.why)
            changes = [*getattr(r.why, "causes", ()), *getattr(r.why, "follows", ())] or [str(r.why)]
            if self.why and summary != str(r.why):
                out.append(f"  why {r.kind} compiled: {summary}:")
                out.extend(f"    {c}" for c in changes)
            else:
                out.append(f"  why {r.kind} compiled: {summary}")
        if self.why and some(r.drifted) != ", ".join(r.drifted):
            out.append(f"  what poisoned {r.kind}:")
            out.extend(f"    {name}" for name in r.drifted)
        return out

    def _repr_html_(self) -> str:
        """Reads at 800 px: the figures first, then one row per program with its inputs summarised by
        name (full shapes on demand, in a `<details>`), and the summarised reason it compiled."""
        esc, h = html.escape, _html
        hits, misses, entries = self.stats
        chips = "".join(h.chip(f"{k} {v}") for k, v in (("hits", hits), ("misses", misses), ("entries", entries)))
        chips += h.chip(f"poisoned {self.poisoned}", "warning" if self.poisoned else "plain")
        out = [f"<div class='nitro-stats' style='text-align: left'><div style='font-weight: 600'>nitro_ipy compile "
               f"cache</div><div style='display: flex; flex-wrap: wrap'>{chips}</div>"]
        cell = "style='text-align: left; vertical-align: top; padding: 2px 8px 2px 0'"
        num = "style='text-align: right; vertical-align: top; padding: 2px 8px 2px 0; white-space: nowrap'"
        if self.rows:
            out.append("<table class='nitro-stats-table' style='border-collapse: collapse; margin: 4px 0; "
                       "max-width: 100%'><thead><tr>")
            for name, style in (("state", cell), ("program", cell), ("inputs", cell), ("compile s", num),
                                ("hits", num)):
                out.append(f"<th {style[:-1]}; white-space: nowrap'>{name}</th>")
            out.append("</tr></thead><tbody>")
            for r in self.rows:
                tone = "plain" if r.state.startswith("live") else "warning"
                inputs = esc(r.inputs or r.short_shapes)
                full = (f"<details><summary>{inputs}</summary><code style='white-space: pre-wrap'>"
                        f"{esc(r.shapes)}</code></details>")
                more = h.why_html(r.why)
                if self.why:
                    more = more.replace("<details ", "<details open ")
                why = (f"<tr><td></td><td colspan='4' {cell[:-1]}; opacity: 0.85'>why {esc(r.kind)} compiled: "
                       f"{more}</td></tr>" if r.why else "")
                out.append(
                    f"<tr style='border-top: 1px solid var(--jp-border-color2, rgba(128,128,128,0.3))'>"
                    f"<td {cell}>{h.chip(r.state, tone)}</td><td {cell[:-1]}; white-space: nowrap'><code>"
                    f"{esc(r.kind)}</code> [{esc(r.hooks)}]</td><td {cell}>{full}</td>"
                    f"<td {num} title='trace {r.trace_s:.2f} s + XLA {r.compile_s:.2f} s'>"
                    f"{r.trace_s + r.compile_s:.2f}</td><td {num}>{r.hits}</td></tr>{why}"
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
        if self.swept:
            out.append(f"<p>{esc(self.swept)}</p>")
        out.append("</div>")
        return h.box("".join(out), "warning" if self.poisoned else "plain", "nitro-stats-box")


def _clip(text: str, width: int) -> str:
    """`text`, cut to `width` characters with an ellipsis when longer."""
    return text if len(text) <= width else text[: width - 3] + "..."


def compact_shapes(entry) -> str:
    """`entry.shapes()` for a terminal: parameters, gradients and optimizer state summarized by their
    array count, so the batch shapes (what usually moves a key) stay in view."""
    groups: dict = {}
    for sig in entry.key.args.sigs:
        groups.setdefault((sig.path or "arg").split("[")[0], []).append(sig)
    parts = []
    for name, sigs in groups.items():
        if name == "guard":  # the optimizer's non-finite bookkeeping (`_guard`), never what moved a key
            continue
        if name in _SUMMARIZED:
            parts.append(f"{name}: {len(sigs)} array{'s' if len(sigs) != 1 else ''}")
        else:  # scalars (Device fields, counts) left out, as in `Entry.shapes()`
            parts.extend(f"{s.path or 'arg'}{list(s.shape)}" for s in sigs if s.shape)
    return ", ".join(parts)


_NAMES = {"params": "parameters", "grads": "gradients", "opt_state": "optimizer state"}


# Inputs the handle passes for its own bookkeeping, not the user's: the non-finite guard (`_guard`).
_BOOKKEEPING = ("guard",)


def summarise_inputs(entry) -> str:
    """A program's inputs in words: parameters, gradients and optimizer state as value counts per dtype
    (the flat buffers; with the parameters' layer groups), batch arrays with their shapes; scalars left out.

    `parameters 16 float32 (v, w); batch x [16, 3], y [16]`"""
    groups: dict = {}
    for sig in entry.key.args.sigs:
        groups.setdefault((sig.path or "arg").split("[")[0].split(".")[0], []).append(sig)
    parts = []
    for name, sigs in groups.items():
        if name in _BOOKKEEPING:
            continue
        if name in _NAMES:
            per_dtype: dict = {}
            for sig in sigs:
                per_dtype[str(sig.dtype)] = per_dtype.get(str(sig.dtype), 0) + math.prod(sig.shape)
            sizes = " + ".join(f"{count:,} {dtype}" for dtype, count in per_dtype.items())
            text = f"{_NAMES[name]} {sizes}"
            groups = [(m.group(1), math.prod(s.shape)) for s in sigs
                      if (m := re.fullmatch(r"grads\[['\"]([^]'\"]*:[^]'\"]*)['\"]\]", s.path or ""))]
            if name == "grads" and groups:  # the flat layout's parameter groups (the optimizer's masks, labels)
                text += f" in {len(groups)} groups (" + ", ".join(f"{g} {c:,}" for g, c in groups) + ")"
            if name == "params":
                layers = list(dict.fromkeys(m.group(1) for s in sigs if (m := re.match(r"params\[['\"]?([^]'\"]+)", s.path or ""))))
                if layers and layers != list(per_dtype):
                    shown = ", ".join(layers[:6]) + (f", +{len(layers) - 6} more" if len(layers) > 6 else "")
                    text += f" ({shown})"
            parts.append(text)
        else:
            arrays = [f"{(s.path or 'arg')[len(name):].strip('[]' + chr(39) + chr(34)) or name} {list(s.shape)}"
                      for s in sigs if s.shape]
            if arrays:
                parts.append(f"{name} " + ", ".join(arrays))
    return "; ".join(parts)


def _row_state(entry) -> str:
    ahead = entry.info.get("ahead")  # made in the background after an edit: for which handle
    if not entry.poisoned:
        state = "live, from disk" if entry.origin == "disk" else "live"
        return f"{state}, {ahead}" if ahead else state
    return f"poisoned ({some(entry.drifted)})" if entry.drifted else "poisoned"


def stats_table(why: bool = False) -> StatsTable:
    """The compile cache as a table: what `%nitro_stats` shows, usable without IPython. `why=True`
    (`%nitro_stats --why`) lists every change behind each compile instead of their summary.

    Re-resolves dependency closures first (`_cache.ensure_fresh()`, a no-op when nothing was redefined),
    so a program compiled against code edited since shows as poisoned rather than live.
    """
    _cache.ensure_fresh()
    stats = _cache.cache_stats()  # first: it folds the hits `nitro_ipy.jit` counted into the entries
    entries = _cache.live_entries() + _cache.poisoned_entries()
    rows, untracked = [], []
    for e in entries:
        mine = tuple(str(item) for item in getattr(e.closure, "untracked", None) or ())
        rows.append(StatsRow(e.kind, ", ".join(e.hook_names), e.shapes(), compact_shapes(e), e.trace_s,
                             e.compile_s, e.hits, _row_state(e), e.why or "", summarise_inputs(e), mine,
                             tuple(e.drifted) if e.poisoned else ()))
        for item in mine:
            text = str(item)
            if text not in untracked:
                untracked.append(text)
    store = _store.store_stats()  # said only when the store is on: off is the quiet default of scripts
    return StatsTable(stats, rows, untracked, len(_cache.poisoned_entries()),
                      store if store.path is not None else None, why)
