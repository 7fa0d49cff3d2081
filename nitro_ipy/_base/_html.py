"""nitro_ipy's rich output as standalone HTML: messages, the progress display, the live panel, the loss chart.

Pure string builders (no IPython, no ipywidgets), so what a live notebook shows is exactly what a saved
one, nbconvert and GitHub show: every colour is a JupyterLab CSS variable with a fallback, backgrounds
are translucent tints over the page and text inherits the page's colour, so light and dark themes (and
exports of either) keep their contrast. Inline styles only: a saved output carries no stylesheet.
"""

import html

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
    """A small inline label (a figure, or a warning)."""
    accent, tint = _TONES[tone]
    weight = "600" if tone != "plain" else "normal"
    return (f"<span class='nitro-chip nitro-chip-{tone}' style='display: inline-block; border: 1px solid "
            f"{accent}; background: {tint}; border-radius: 10px; padding: 0 8px; margin: 2px 4px 2px 0; "
            f"white-space: nowrap; font-weight: {weight}'>{code_html(text)}</span>")


def lines_html(lines) -> str:
    """Plain text lines (compile and epoch lines) as a monospace block that wraps."""
    if not lines:
        return ""
    body = "<br>".join(esc(line) for line in lines)
    return f"<div class='nitro-lines' style='{_MONO}; {_MUTED}; white-space: pre-wrap'>{body}</div>"


# ------------------------------------------------------------------------------------------------ why
def summarise_why(why: str, limit: int = 160) -> str:
    """A compile's reason in one readable phrase. The explanation lists every key component that moved
    (`_explain.explain`, parts joined by "; "); a GraphConst change is named with its values and the
    argument shapes that follow from it are counted, not listed. Anything else is cut at `limit`."""
    if not why:
        return ""
    parts = why.split("; ")
    fields = [p for p in parts if p.startswith("GraphConst")]
    if fields:
        rest = len(parts) - len(fields)
        follow = f", and {rest} argument change{'s' if rest != 1 else ''} that follow" if rest else ""
        text = "; ".join(fields) + follow
    else:
        text = why
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ------------------------------------------------------------------------------------------------ chart
def _nice(lo: float, hi: float) -> tuple:
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0) * 0.1
    pad = (hi - lo) * 0.05
    return lo - pad, hi + pad


def loss_svg(train: list, valid: list, epochs: float | None = None, size: tuple = CHART_SIZE,
             start: float = 0.0) -> str:
    """The loss chart as inline SVG: train loss at sync points (a line), validation loss per epoch (dots).

    **Arguments:**

    - `train`, `valid`: `(epoch, loss)` points, the epoch fractional within an epoch.
    - `epochs`: the x-axis end (the planned epochs), or None for the last point's.
    - `size`: `(width, height)` in px.
    - `start`: the x-axis origin (the epoch the chart starts at).

    **Returns:** the `<svg>` element, or "" when there is nothing to draw.
    """
    pts = [(x, y) for x, y in list(train) + list(valid) if y == y and abs(y) != float("inf")]
    if not pts:
        return ""
    w, h = size
    left, right, top, bottom = 46, 14, 8, 22
    x0 = min(start, min(x for x, _ in pts))
    x1 = max(epochs or 0, max(x for x, _ in pts), x0 + 1e-9)
    y0, y1 = _nice(min(y for _, y in pts), max(y for _, y in pts))
    sx = lambda x: left + (x - x0) / (x1 - x0) * (w - left - right)
    sy = lambda y: top + (y1 - y) / (y1 - y0) * (h - top - bottom)
    fg, grid = "var(--jp-content-font-color2, #888)", "var(--jp-border-color2, rgba(128,128,128,0.35))"
    train_c, valid_c = "var(--jp-brand-color1, #1976d2)", "var(--jp-warn-color1, #f57c00)"
    out = [f"<svg class='nitro-chart' xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' "
           f"viewBox='0 0 {w} {h}' style='max-width: 100%; height: auto; font: 10px sans-serif'>"]
    for i in range(3):  # three y grid lines with their values
        y = y0 + (y1 - y0) * (i + 0.5) / 3
        out.append(f"<line x1='{left}' x2='{w - right}' y1='{sy(y):.1f}' y2='{sy(y):.1f}' style='stroke: {grid}'/>"
                   f"<text x='{left - 4}' y='{sy(y) + 3:.1f}' text-anchor='end' style='fill: {fg}'>{y:.3g}</text>")
    out.append(f"<text x='{left}' y='{h - 6}' style='fill: {fg}'>{x0:.3g}</text><text x='{w - right}' y='{h - 6}' "
               f"text-anchor='end' style='fill: {fg}'>epoch {x1:.3g}</text>")
    if train:
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in train)
        out.append(f"<polyline style='fill: none; stroke: {train_c}; stroke-width: 1.5' points='{path}'/>")
        if len(train) < 3:  # a line of one or two points hardly shows: mark them
            out.extend(f"<circle cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='2' style='fill: {train_c}'/>" for x, y in train)
    for x, y in valid:
        out.append(f"<circle cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='3' style='fill: {valid_c}'/>")
    legend = [("train loss", train_c)] if train else []
    legend += [("valid loss", valid_c)] if valid else []
    for i, (name, colour) in enumerate(legend):
        x = w - right - 150 + i * 78
        out.append(f"<rect x='{x}' y='{top}' width='10' height='3' style='fill: {colour}'/>"
                   f"<text x='{x + 14}' y='{top + 5}' style='fill: {fg}'>{name}</text>")
    out.append("</svg>")
    return "".join(out)


class LossChart:
    """The loss chart as an output: SVG in a notebook (`text/html`, `image/svg+xml`), a summary line as
    text. What `Nitro.plot()` returns and what the live panel draws."""

    def __init__(self, train: list, valid: list, epochs: float | None = None, start: float = 0.0):
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
