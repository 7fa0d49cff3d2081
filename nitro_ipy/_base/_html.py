"""nitro_ipy's rich output as standalone HTML: messages, the progress display, the live panel, the loss chart.

Pure string builders (no IPython, no ipywidgets), so what a live notebook shows is exactly what a saved
one, nbconvert and GitHub show: every colour is a JupyterLab CSS variable with a fallback, backgrounds
are translucent tints over the page and text inherits the page's colour, so light and dark themes (and
exports of either) keep their contrast. Inline styles only: a saved output carries no stylesheet.
"""

import html
import math

from ._report import LOOKS, Explanation, Look, why_summary

# (accent, tint) per tone. The tint is translucent: over a light page it is a pale wash, over a dark page
# a dark one, and the text keeps the page's own colour either way.
_TONES = {
    "info": ("var(--jp-info-color1, #0288d1)", "rgba(2, 136, 209, 0.10)"),
    "warning": ("var(--jp-warn-color1, #f57c00)", "rgba(245, 124, 0, 0.12)"),
    "success": ("var(--jp-success-color1, #388e3c)", "rgba(56, 142, 60, 0.10)"),
    "error": ("var(--jp-error-color1, #d32f2f)", "rgba(211, 47, 47, 0.10)"),
    "plain": ("var(--jp-border-color1, #9e9e9e)", "transparent"),
}
# No quotes inside a style value: every style here sits in a single-quoted attribute.
_FONT = ("font-family: var(--jp-ui-font-family, system-ui, -apple-system, sans-serif); "
         "font-size: var(--jp-content-font-size1, 14px); line-height: 1.4; "
         "color: var(--jp-content-font-color1, inherit)")
_MONO = "font-family: var(--jp-code-font-family, monospace); font-size: var(--jp-code-font-size, 13px)"
_MUTED = "color: var(--jp-content-font-color2, inherit); opacity: 0.85"
CHART_SIZE = (440, 150)  # px: fits an 800 px window beside nothing, and reads at a glance


def esc(text) -> str:
    return html.escape(str(text), quote=True)


def code_html(text: str) -> str:
    """Escape `text`, keeping its `backticked` spans as <code>."""
    parts = esc(text).split("`")
    return "".join(f"<code style='{_MONO}'>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def box(body: str, tone: str = "info", cls: str = "") -> str:
    """`body` (HTML) in a box with a left accent border in `tone`'s colour."""
    accent, tint = _TONES[tone]
    return (f"<div class='nitro-box nitro-{tone} {cls}' style='{_FONT}; border-left: 4px solid {accent}; "
            f"background: {tint}; padding: 6px 10px; margin: 4px 0; border-radius: 2px; "
            f"max-width: 100%; box-sizing: border-box; overflow-wrap: anywhere'>{body}</div>")


def titled(title: str, details: str, tone: str, cls: str = "") -> str:
    """A box with a bold title line and the details under it (both plain text with `code` spans)."""
    return box(f"<div style='font-weight: 600'>{code_html(title)}</div>"
               f"<div style='margin-top: 2px'>{code_html(details)}</div>", tone, cls)


def chip(text: str, tone: str = "plain") -> str:
    """A small inline label (a figure, or a warning). It wraps inside its own border when the box is
    narrower than it: nothing overhangs a narrow panel."""
    accent, tint = _TONES[tone]
    weight = "600" if tone != "plain" else "normal"
    return (f"<span class='nitro-chip nitro-chip-{tone}' style='display: inline-block; border: 1px solid "
            f"{accent}; background: {tint}; border-radius: 10px; padding: 0 8px; margin: 2px 4px 2px 0; "
            f"max-width: 100%; box-sizing: border-box; overflow-wrap: anywhere; font-weight: {weight}'>"
            f"{code_html(text)}</span>")


_LINES_STYLE = f"{_MONO}; {_MUTED}; white-space: pre-wrap; overflow-wrap: anywhere; margin: 2px 0"


def lines_html(lines) -> str:
    """Plain text lines as the reporter draws its quiet lines: a monospace, muted block that wraps at
    spaces (and inside a word only when one word is wider than the output)."""
    if not lines:
        return ""
    body = "".join(f"<div class='nitro-line'>{esc(line)}</div>" for line in lines)
    return f"<div class='nitro-lines' style='{_LINES_STYLE}'>{body}</div>"


def details_html(label: str, items, mono: bool = True) -> str:
    """A `<details>`: `label` as its one-line summary, `items` one per line once opened."""
    style = f"{_MONO}; " if mono else ""
    body = "".join(f"<div>{code_html(item)}</div>" for item in items)
    return (f"<details class='nitro-more' style='margin-top: 2px'><summary style='cursor: pointer; {_MUTED}'>"
            f"{esc(label)}</summary><div style='{style}white-space: pre-wrap; overflow-wrap: anywhere; "
            f"padding-left: 12px'>{body}</div></details>")


# ------------------------------------------------------------------------------------------------ messages
_PREFIXES = ("nitro_ipy: ", "! ")


def _details(text: str) -> str:
    for prefix in _PREFIXES:
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


def _line_html(msg) -> str:
    more = "".join(details_html(f.label, f.items) for f in msg.more)
    return f"<div class='nitro-line nitro-{msg.kind}'>{esc(msg.text)}{more}</div>"


def message_html(msg) -> str:
    """One `_report.Message` as the notebook draws it, by its kind's look (`_report.LOOKS`): a quiet
    line, or a box in its tone with its title; the lists its text sums up in `<details>` under it."""
    look = LOOKS.get(msg.kind, Look(True, "info"))
    if not look.box:
        return f"<div class='nitro-lines' style='{_LINES_STYLE}'>{_line_html(msg)}</div>"
    cls = f"nitro-message nitro-{msg.kind}"
    more = "".join(details_html(f.label, f.items) for f in msg.more)
    details = _details(msg.text)
    if look.title is None:
        return box(code_html(details) + more, look.tone, cls)
    return box(f"<div style='font-weight: 600'>{code_html(look.title(msg.data))}</div>"
               f"<div style='margin-top: 2px'>{code_html(details[:1].upper() + details[1:])}</div>{more}",
               look.tone, cls)


def messages_html(messages) -> str:
    """Messages in order, as one output draws them: consecutive lines in one block, boxes between."""
    out, run = [], []
    for msg in messages:
        if not LOOKS.get(msg.kind, Look(True, "info")).box:
            run.append(_line_html(msg))
            continue
        if run:
            out.append(f"<div class='nitro-lines' style='{_LINES_STYLE}'>{''.join(run)}</div>")
            run = []
        out.append(message_html(msg))
    if run:
        out.append(f"<div class='nitro-lines' style='{_LINES_STYLE}'>{''.join(run)}</div>")
    return "".join(out)


# ------------------------------------------------------------------------------------------------ why
def summarise_why(why) -> str:
    """A compile's reason in one readable phrase: its causes (a GraphConst field, a hook), with the
    argument changes that follow from them counted (`_report.Explanation.summary`)."""
    return why_summary(why)


def why_html(why) -> str:
    """A compile's reason as HTML: the summary, and what it counted in a `<details>`."""
    if not why:
        return ""
    folds = why.folded() if isinstance(why, Explanation) else ()
    return code_html(summarise_why(why)) + "".join(details_html(f.label, f.items) for f in folds)


# ------------------------------------------------------------------------------------------------ chart
def _step(span: float, most: int) -> float:
    """The smallest 1-2-5 step that cuts `span` into at most `most` parts."""
    if span <= 0:
        return 1.0
    unit = 10 ** math.floor(math.log10(span / most))
    for m in (1, 2, 5, 10):
        if span / (m * unit) <= most:
            return m * unit
    return 10 * unit


def _ticks(lo: float, hi: float, most: int = 4) -> tuple:
    """Round values between `lo` and `hi`: the widest 1-2-5 step that gives 3 to `most` + 1 of them.
    Returns `(ticks, step)`."""
    step = _step(hi - lo, most)
    while True:
        first = math.ceil(lo / step - 1e-9)
        out = []
        k = first
        while k * step <= hi + 1e-9 * step:
            out.append(round(k * step, 12))
            k += 1
        if len(out) >= 3 or step < (hi - lo) * 1e-6:
            return out, step
        digits = f"{step:.0e}"  # the next smaller 1-2-5 step: 5 -> 2 -> 1 -> 0.5
        step = step * (0.4 if digits.startswith("5") else 0.5)


def _tick_text(value: float, step: float) -> str:
    digits = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{value:.{digits}f}"


def y_range(train: list, valid: list) -> tuple:
    """The loss axis's range: every validation point and the run's train loss. The first train points
    of a run can lie far above the rest (the loss of untrained parameters); when they would squeeze the
    run into the bottom of the chart, the axis shows the run and those points leave it at the top."""
    ys = [y for _, y in train] + [y for _, y in valid]
    lo, hi = min(ys), max(ys)
    if len(train) >= 10:
        settled = [y for _, y in train[len(train) // 10:]] + [y for _, y in valid]
        top = max(settled)
        if hi - lo > 2.5 * (top - lo) > 0:
            hi = top
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0) * 0.1
    pad = (hi - lo) * 0.08
    return lo - pad, hi + pad


def _finite(points) -> list:
    return [(float(x), float(y)) for x, y in points if y == y and abs(y) != float("inf")]


def loss_svg(train: list, valid: list, epochs: float | None = None, size: tuple = CHART_SIZE,
             start: float | None = None) -> str:
    """The loss chart as inline SVG: train loss at sync points (a solid line), validation loss per epoch
    (a dashed line through round markers), so the two read apart without colour; epochs on the x axis
    with whole-number ticks, the loss on the y axis with round ticks (`y_range`).

    **Arguments:**

    - `train`, `valid`: `(epoch, loss)` points, the epoch fractional within an epoch (`1.5`: halfway
      through the second), counted over the handle's life.
    - `epochs`: the x-axis end (the epoch the running call ends at), or None for the last point's.
    - `size`: `(width, height)` in px.
    - `start`: the x-axis origin, or None for the whole epoch before the first point.

    **Returns:** the `<svg>` element, or "" when there is nothing to draw.
    """
    train, valid = _finite(train), _finite(valid)
    pts = train + valid
    if not pts:
        return ""
    w, h = size
    left, right, top, bottom = 46, 12, 16, 24
    first = min(x for x, _ in pts)
    x0 = math.floor(first - 1e-9) if start is None else min(start, math.floor(first - 1e-9))
    x1 = max(math.ceil(max(epochs or 0, max(x for x, _ in pts)) - 1e-9), x0 + 1)
    y0, y1 = y_range(train, valid)
    pw, ph = w - left - right, h - top - bottom
    sx = lambda x: left + (x - x0) / (x1 - x0) * pw  # noqa: E731
    sy = lambda y: top + (y1 - y) / (y1 - y0) * ph  # noqa: E731
    fg, grid = "var(--jp-content-font-color2, #888)", "var(--jp-border-color2, rgba(128,128,128,0.35))"
    train_c, valid_c = "var(--jp-brand-color1, #1976d2)", "var(--jp-warn-color1, #f57c00)"
    out = [f"<svg class='nitro-chart' xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' "
           f"viewBox='0 0 {w} {h}' style='max-width: 100%; height: auto; font: 10px sans-serif'>",
           f"<defs><clipPath id='nitro-plot-area'><rect x='{left}' y='{top - 2}' width='{pw}' "
           f"height='{ph + 4}'/></clipPath></defs>"]
    yticks, ystep = _ticks(y0, y1, 4)
    out.append("<g class='nitro-y-axis'>")
    for y in yticks:
        out.append(f"<line x1='{left}' x2='{w - right}' y1='{sy(y):.1f}' y2='{sy(y):.1f}' style='stroke: {grid}'/>"
                   f"<text class='nitro-tick' x='{left - 4}' y='{sy(y) + 3:.1f}' text-anchor='end' "
                   f"style='fill: {fg}'>{_tick_text(y, ystep)}</text>")
    out.append("</g><g class='nitro-x-axis'>")
    xstep = max(1, int(_step(x1 - x0, 8)))
    base = h - bottom
    out.append(f"<line x1='{left}' x2='{w - right}' y1='{base}' y2='{base}' style='stroke: {fg}'/>")
    for x in range(int(x0), int(x1) + 1):
        if (x - int(x0)) % xstep:
            continue
        out.append(f"<line x1='{sx(x):.1f}' x2='{sx(x):.1f}' y1='{base}' y2='{base + 3}' style='stroke: {fg}'/>"
                   f"<text class='nitro-tick' x='{sx(x):.1f}' y='{base + 13}' text-anchor='middle' "
                   f"style='fill: {fg}'>{x}</text>")
    out.append(f"<text class='nitro-axis-label' x='{left - 9}' y='{base + 13}' text-anchor='end' "
               f"style='fill: {fg}'>epoch</text></g>")
    out.append("<g clip-path='url(#nitro-plot-area)'>")
    if train:
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in train)
        out.append(f"<polyline class='nitro-train' style='fill: none; stroke: {train_c}; stroke-width: 1.5' "
                   f"points='{path}'/>")
        if len(train) < 3:  # a line of one or two points hardly shows: mark them (squares, not valid's dots)
            out.extend(f"<rect class='nitro-train-point' x='{sx(x) - 2:.1f}' y='{sy(y) - 2:.1f}' width='4' "
                       f"height='4' style='fill: {train_c}'/>" for x, y in train)
    if valid:
        if len(valid) > 1:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in valid)
            out.append(f"<polyline class='nitro-valid' style='fill: none; stroke: {valid_c}; stroke-width: 1.5; "
                       f"stroke-dasharray: 4 3' points='{path}'/>")
        out.extend(f"<circle class='nitro-valid-point' cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='3' "
                   f"style='fill: {valid_c}'/>" for x, y in valid)
    out.append("</g>")
    legend = [("train loss", train_c, "", False)] if train else []
    legend += [("valid loss", valid_c, "; stroke-dasharray: 4 3", True)] if valid else []
    for i, (name, colour, dash, dot) in enumerate(legend):
        x = w - right - 160 + i * 84
        out.append(f"<g class='nitro-legend'><line x1='{x}' x2='{x + 18}' y1='{top - 9}' y2='{top - 9}' "
                   f"style='stroke: {colour}; stroke-width: 1.5{dash}'/>"
                   + (f"<circle cx='{x + 9}' cy='{top - 9}' r='3' style='fill: {colour}'/>" if dot else "")
                   + f"<text x='{x + 22}' y='{top - 6}' style='fill: {fg}'>{name}</text></g>")
    out.append("</svg>")
    return "".join(out)


class LossChart:
    """The loss chart as an output: SVG in a notebook (`text/html`, `image/svg+xml`), a summary line as
    text. What `Nitro.plot()` returns and what the live panel draws."""

    def __init__(self, train: list, valid: list, epochs: float | None = None, start: float | None = None):
        self.train, self.valid, self.epochs, self.start = list(train), list(valid), epochs, start

    def svg(self) -> str:
        return loss_svg(self.train, self.valid, self.epochs, start=self.start)

    def __repr__(self) -> str:
        if not self.train and not self.valid:
            return "nitro_ipy loss chart: no training yet"
        parts = []
        if self.train:
            parts.append(f"train loss {self.train[0][1]:.4g} → {self.train[-1][1]:.4g} "
                         f"({len(self.train)} points)")
        if self.valid:
            parts.append(f"valid loss {self.valid[-1][1]:.4g} at epoch {self.valid[-1][0]:g}")
        return "nitro_ipy loss chart: " + ", ".join(parts)

    def _repr_mimebundle_(self, include=None, exclude=None):
        svg = self.svg()
        bundle = {"text/plain": repr(self)}
        if svg:
            bundle["text/html"] = f"<div class='nitro-plot' style='{_FONT}'>{svg}</div>"
        return bundle
