"""One self-contained HTML page about a training run: verdict, summary, plots, validation grids, config, environment.

Everything the page shows is inside it (plots as inline SVG drawn by matplotlib, images as data URIs), so it can be
mailed, attached to a ticket or opened on a laptop without the run folder, a server or a network.
"""

from __future__ import annotations

import base64
import html
import io
import math
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

from sdtrain import __version__
from sdtrain.errors import UserError
from sdtrain.paths import FIRST_BATCH
from sdtrain.runview import Metrics, Run, environment, is_number, load_run, thin

# A run of months logs hundreds of grids; past these the page would weigh more than the run's story is worth.
MAX_IMAGES = 12
# A 4k-wide grid of 512 px samples is tens of MB as PNG; in a page it only needs to fit a screen.
_IMAGE_MAX_BYTES = 1_500_000
_IMAGE_MAX_WIDTH = 1600

_EVAL = re.compile(r"(^|_)(fid|kid|clip|clip_score|adherence|lpips|psnr|ssim|eval|val|validation)(_|$)")
_PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f")


# ------------------------------------------------------------------------------------------ judging a run


@dataclass
class Verdict:
    level: str
    """good, warn, bad or none (nothing to judge yet)."""
    text: str


def verdict(metrics: Metrics) -> Verdict:
    if not metrics.records:
        return Verdict("none", "No metrics logged yet: the run has not reached its first logging step.")
    bad = metrics.non_finite()
    if bad:
        key, step, value = bad[0]
        return Verdict("bad", f"{value} in {key} at step {step:,} ({len(bad)} non-finite value(s)): training "
                              "diverged. Lower optim.lr or enable optim.grad_clip, and resume from a checkpoint "
                              "before that step.")
    values = [v for _, v in metrics.series("loss")]
    if len(values) < 4:
        return Verdict("none", f"{len(values)} logged step(s) with a loss: too few to judge its trend yet.")
    half = len(values) // 2
    first, last = statistics.median(values[:half]), statistics.median(values[-half:])
    change = (last - first) / abs(first) if first else 0.0
    compared = (f"median {last:.4g} over the last half of the logged steps vs {first:.4g} over the first "
                f"({change:+.0%})")
    if change < -0.05:
        return Verdict("good", f"Loss is falling: {compared}.")
    if change > 0.05:
        return Verdict("bad", f"Loss is rising: {compared}. Check optim.lr (too high?) and the data.")
    return Verdict("warn", f"Loss is flat: {compared}. Early in a run that hints at too low a learning rate; "
                           "late in one, at convergence.")


def _training_seconds(metrics: Metrics) -> tuple[float, bool] | None:
    """Seconds of training and whether they are estimated.

    A clock stamp per line is exact; without one, each line's img/s covers the samples since the line before.
    """
    stamps = [r["time"] for r in metrics.records if is_number(r.get("time"))]
    if len(stamps) >= 2:
        return max(stamps) - min(stamps), False
    seconds, previous = 0.0, 0
    for record in metrics.records:
        rate, samples = record.get("img_per_s"), record.get("samples")
        if is_number(rate) and is_number(samples) and rate > 0 and math.isfinite(rate):
            seconds += max(samples - previous, 0) / rate
            previous = samples
    return (seconds, True) if seconds > 0 else None


# ------------------------------------------------------------------------------------------ plots as SVG


@dataclass
class Group:
    """One plot: metrics sharing a y axis."""

    title: str
    keys: list[str]
    ylabel: str
    section: str
    log_if_wide: bool = False
    smooth: bool = False


def _is_loss(key: str) -> bool:
    return "loss" in key or key in ("reconstruction", "kl")


def metric_groups(keys: list[str]) -> list[Group]:
    """Known metrics together by meaning and scale; any other key (an evaluation, say) on a plot of its own."""
    rules = [
        ("Loss", _is_loss, "loss", "Training", True, True),
        ("Learning rate", lambda k: k == "lr" or k.startswith("lr_"), "learning rate", "Training", False, False),
        ("Throughput", lambda k: k.endswith("_per_s"), "images / s", "Training", False, False),
        ("Gradient norm", lambda k: k.startswith("grad_norm"), "norm before clipping", "Training", True, False),
        ("Samples seen", lambda k: k == "samples", "samples", "Progress", False, False),
        ("Epoch", lambda k: k == "epoch", "epoch", "Progress", False, False),
        ("Samples skipped and filtered", lambda k: k in ("skipped_samples", "filtered_samples"), "samples",
         "Progress", False, False),
    ]
    groups: list[Group] = []
    left = list(keys)
    for title, match, ylabel, section, log_if_wide, smooth in rules:
        chosen = [k for k in left if match(k)]
        if chosen:
            groups.append(Group(title, chosen, ylabel, section, log_if_wide, smooth))
            left = [k for k in left if k not in chosen]
    for key in left:
        section = "Evaluation" if _EVAL.search(key) else "Other metrics"
        groups.append(Group(key, [key], key, section, log_if_wide=True))
    order = ["Training", "Evaluation", "Other metrics", "Progress"]
    return sorted(groups, key=lambda g: order.index(g.section))


def _smoothed(values: list[float]) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased so the start is not pulled to zero.

    Its window grows with the run (about a tenth of the points), so neither a short run lags nor a long one wiggles.
    """
    weight = min(0.98, max(0.0, 1 - 10 / len(values)))
    out, average = [], 0.0
    for i, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**i))
    return out


_INK = "#5d6677"  # axes and labels: a grey that reads on the page's light and dark themes alike


def plot_svg(group: Group, metrics: Metrics) -> str:
    """One plot as inline SVG, drawn by matplotlib: the group's series over the whole run's steps (so a step lines
    up across plots), a loss smoothed over its faint raw curve, a log axis for a value falling over decades, and a
    red cross at the top for every step a value was not finite."""
    from matplotlib import rc_context
    from matplotlib.figure import Figure

    series = {key: metrics.series(key) for key in group.keys}
    finite = {k: [p for p in pts if math.isfinite(p[1])] for k, pts in series.items()}
    values = [v for pts in finite.values() for _, v in pts]
    figure = Figure(figsize=(6.4, 3.0), dpi=100, layout="constrained")
    figure.patch.set_alpha(0)
    axes = figure.add_subplot()
    axes.patch.set_alpha(0)
    marks = {}
    for i, key in enumerate(group.keys):
        marks[f"marks-{i}"] = _draw_series(axes, finite[key], _PALETTE[i % len(_PALETTE)], group.smooth, key,
                                           f"marks-{i}")
    log = group.log_if_wide and values and min(values) > 0 and max(values) / min(values) >= 10
    if log:
        axes.set_yscale("log")
    elif values and min(values) >= 0:
        axes.set_ylim(bottom=0)  # counts and rates start at zero: a plot hugging zero shows it
    steps = [r["step"] for r in metrics.records]
    axes.set_xlim(min(steps) - (max(steps) == min(steps)), max(steps) + (max(steps) == min(steps)))
    for step, _ in (p for pts in series.values() for p in pts if not math.isfinite(p[1])):
        axes.annotate("×", (step, 1), xycoords=("data", "axes fraction"), ha="center", va="top", color="#c62828",
                      fontsize=14, fontweight="bold")
    _style(axes, group.ylabel + (" (log scale)" if log else ""))
    buffer = io.StringIO()
    # Text stays text (searchable, and the page's font), and ids are salted alike: the same run, the same page.
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "sdtrain"}):
        figure.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    svg = buffer.getvalue()
    # Inline in HTML an SVG needs no namespace declarations (URLs the page must not carry, though never fetched).
    svg = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", svg[svg.index("<svg"):])
    svg = re.sub(r"<metadata>.*?</metadata>\s*", "", svg, flags=re.S)
    for gid, titles in marks.items():
        svg = _titled_marks(svg, gid, titles)
    label = html.escape(f"{group.title} over steps")
    return svg.replace("<svg ", f'<svg class="plot" role="img" aria-label="{label}" ', 1)


def _titled_marks(svg: str, gid: str, titles: list[str]) -> str:
    """Each point of the marks drawn with `gid` given its value as a hover title (matplotlib draws a marker per
    point as a ``<use>``, in order)."""
    found = re.search(rf'<g id="{gid}">(.*?)</g>\s*</g>', svg, flags=re.S)
    if not found:
        return svg
    uses = iter(titles)
    body = re.sub(r"<use ([^>]*?)/>", lambda m: f'<use {m.group(1)}><title>{html.escape(next(uses, ""))}</title></use>',
                  found.group(1))
    return svg[:found.start(1)] + body + svg[found.end(1):]


def _draw_series(axes: Any, points: list[tuple[int, float]], color: str, smooth: bool, key: str, gid: str
                 ) -> list[str]:
    """Draws a series and its hover marks; returns the marks' titles."""
    if not points:
        return []
    steps, values = thin([s for s, _ in points], [v for _, v in points])
    faint = smooth and len(points) >= 20
    axes.plot(steps, values, color=color, linewidth=1 if faint else 1.8, alpha=.35 if faint else 1, label=key)
    if faint:
        axes.plot(steps, _smoothed(values), color=color, linewidth=1.8, label=f"{key}, smoothed")
    # Every point hoverable would be thousands of elements on a long run; a few hundred are enough to read. Shown
    # as dots on a short run, invisible (hover targets) on a long one.
    marks = points[::max(1, len(points) // 300)]
    if marks[-1] != points[-1]:
        marks.append(points[-1])
    axes.plot([s for s, _ in marks], [v for _, v in marks], linestyle="none", marker="o", color=color,
              markersize=4 if len(points) <= 60 else 7, alpha=1 if len(points) <= 60 else 0, gid=gid)
    return [f"{key} = {value:.5g} at step {step:,}" for step, value in marks]


def _style(axes: Any, ylabel: str) -> None:
    from matplotlib.ticker import EngFormatter, MaxNLocator

    axes.set_xlabel("step", color=_INK)
    axes.set_ylabel(ylabel, color=_INK)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.xaxis.set_major_formatter(EngFormatter(sep=""))
    axes.grid(True, color=_INK, alpha=.2, linewidth=.8)
    axes.tick_params(colors=_INK, labelsize=9)
    for spine in ("top", "right"):
        axes.spines[spine].set_visible(False)
    for spine in ("left", "bottom"):
        axes.spines[spine].set_color(_INK)


# ------------------------------------------------------------------------------------------ the page

_PAGE = Template("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>$title</title>
<style>
:root { --fg: #1d2330; --muted: #5d6677; --bg: #ffffff; --panel: #f4f6f9; --line: #d5dae2;
        --good: #2e7d32; --warn: #a86b00; --bad: #c62828; --none: #5d6677; }
@media (prefers-color-scheme: dark) {
  :root { --fg: #e6e9ef; --muted: #9aa3b2; --bg: #14171c; --panel: #1d2129; --line: #343a46;
          --good: #66bb6a; --warn: #f0b429; --bad: #ef5350; --none: #9aa3b2; }
}
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg); background: var(--bg);
       margin: 0 auto; max-width: 1320px; padding: 20px 28px 40px; }
h1 { font-size: 1.5em; margin: 0 0 2px; } h2 { font-size: 1.2em; margin: 30px 0 10px; }
h3 { font-size: 1em; margin: 0 0 4px; }
.muted, .tick { color: var(--muted); fill: var(--muted); } .muted { font-size: .9em; }
code, pre { font: 13px/1.4 ui-monospace, SFMono-Regular, Menlo, monospace; }
pre { background: var(--panel); padding: 12px; overflow: auto; border-radius: 6px; }
nav a { margin-right: 14px; color: inherit; }
.verdict { border-left: 6px solid var(--none); background: var(--panel); padding: 10px 14px; margin: 16px 0;
           border-radius: 4px; font-size: 1.05em; }
.verdict.good { border-color: var(--good); } .verdict.warn { border-color: var(--warn); }
.verdict.bad { border-color: var(--bad); }
.verdict b { color: var(--none); } .verdict.good b { color: var(--good); } .verdict.warn b { color: var(--warn); }
.verdict.bad b { color: var(--bad); }
dl.summary { display: grid; grid-template-columns: repeat(auto-fill, minmax(230px, 1fr)); gap: 10px; margin: 0; }
dl.summary div { background: var(--panel); border-radius: 6px; padding: 8px 12px; }
dl.summary dt { color: var(--muted); font-size: .85em; } dl.summary dd { margin: 0; font-weight: 600; }
.bar { height: 6px; background: var(--line); border-radius: 3px; margin-top: 4px; }
.bar span { display: block; height: 100%; background: var(--good); border-radius: 3px; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(480px, 1fr)); gap: 18px; }
.plots.small { grid-template-columns: repeat(auto-fill, minmax(340px, 1fr)); }
figure { margin: 0; } figcaption { font-size: .85em; color: var(--muted); }
.plots figure { background: var(--panel); border-radius: 6px; padding: 10px 12px; }
svg.plot { width: 100%; height: auto; display: block; font-size: 12px; }
svg.plot .grid { stroke: var(--line); stroke-width: 1; } svg.plot .axis { stroke: var(--muted); }
svg.plot .label { fill: var(--fg); font-size: 13px; }
svg.plot .series { fill: none; stroke-width: 2; stroke-linejoin: round; }
svg.plot .series.raw { stroke-width: 1; opacity: .35; }
svg.plot .hit { fill-opacity: 0; } svg.plot .hit:hover, svg.plot .point:hover { fill-opacity: 1; r: 6; }
svg.plot .nonfinite { fill: var(--bad); font-weight: 700; font-size: 14px; }
.key { display: inline-block; margin-right: 14px; }
.key i { display: inline-block; width: 12px; height: 3px; vertical-align: middle; margin-right: 5px; }
.gallery figure { margin: 0 0 18px; } .gallery img { max-width: 100%; height: auto;
  border: 1px solid var(--line); border-radius: 4px; background: #fff; }
.gallery img.upscaled { image-rendering: pixelated; }
.gallery.slides figure { display: none; } .gallery.slides figure.current { display: block; }
.controls { display: none; align-items: center; gap: 12px; margin-bottom: 10px; }
.js .controls { display: flex; } .controls input[type=range] { flex: 1; max-width: 600px; }
table { border-collapse: collapse; } td, th { text-align: left; padding: 4px 14px 4px 0; vertical-align: top; }
th { color: var(--muted); font-weight: normal; } tr + tr td { border-top: 1px solid var(--line); }
details summary { cursor: pointer; margin-bottom: 6px; }
</style>
</head>
<body>
<header>
<h1>$heading</h1>
<div class="muted">$path &middot; report written $written by sdtrain $version</div>
<nav class="muted">$nav</nav>
</header>
<div class="verdict $verdict_level"><b>$verdict_label</b> $verdict_text</div>
<section id="summary"><dl class="summary">$summary</dl>$notes</section>
<section id="metrics"><h2>Metrics</h2>$plots</section>
<section id="samples"><h2>Validation samples</h2>$gallery</section>
<section id="data"><h2>Training data</h2>$data</section>
<section id="checkpoints"><h2>Checkpoints</h2>$checkpoints</section>
<section id="config"><h2>Config</h2>$config</section>
<section id="environment"><h2>Environment</h2>$environment</section>
<p id="render-check" class="muted">Render check: not run (scripts are off).</p>
<script>
// Slides when scripts run; without them the gallery stays a plain list, newest first.
(function () {
  document.documentElement.classList.add("js");
  var gallery = document.querySelector(".gallery"), slider = document.getElementById("slider");
  if (!gallery || !slider) return;
  var figures = gallery.querySelectorAll("figure"), all = document.getElementById("show-all");
  function show() {
    gallery.classList.toggle("slides", !all.checked);
    figures.forEach(function (f, i) { f.classList.toggle("current", i === figures.length - 1 - +slider.value); });
    document.getElementById("slide-label").textContent = figures[figures.length - 1 - +slider.value].dataset.label;
  }
  slider.addEventListener("input", show); all.addEventListener("change", show); show();
})();
// Proof that the page is whole: every image decoded, every plot laid out. Headless browsers in the tests read it.
window.addEventListener("load", function () {
  var images = Array.prototype.slice.call(document.images);
  var plots = Array.prototype.slice.call(document.querySelectorAll("svg.plot"));
  var goodImages = images.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  var goodPlots = plots.filter(function (s) {
    var box = s.getBoundingClientRect();
    return box.width > 0 && box.height > 0;
  }).length;
  var check = document.getElementById("render-check");
  check.textContent = "Render check: " + goodPlots + "/" + plots.length + " plots and " + goodImages + "/" +
    images.length + " images rendered.";
  check.dataset.status = goodPlots === plots.length && goodImages === images.length ? "ok" : "fail";
});
</script>
</body>
</html>
""")

_VERDICT_LABELS = {"good": "Training works.", "warn": "Check this.", "bad": "Problem.", "none": "Too early to tell."}


def _num(value: Any) -> str:
    if not is_number(value):
        return html.escape(str(value))
    if math.isfinite(value) and float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:.4g}"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86400:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
    return f"{seconds / 86400:.1f} days"


def _item(label: str, value: str, extra: str = "") -> str:
    return f"<div><dt>{html.escape(label)}</dt><dd>{value}</dd>{extra}</div>"


def _section(config: dict[str, Any], name: str) -> dict[str, Any]:
    value = config.get(name)
    return value if isinstance(value, dict) else {}


def _newest_meta(run: Run) -> dict[str, Any]:
    for _, meta in reversed(run.checkpoints):
        if meta:
            return meta
    return {}


def _progress_items(run: Run) -> list[str]:
    metrics, meta = run.metrics, _newest_meta(run)
    step = metrics.records[-1]["step"] if metrics.records else meta.get("step", 0)
    max_steps = _section(run.config, "train").get("max_steps")
    stage = run.config.get("stage") or meta.get("stage") or "?"
    mode = run.config.get("mode") or (meta.get("task") or {}).get("mode")
    items = [_item("Stage / mode", html.escape(f"{stage} / {mode}" if mode else str(stage)))]
    if is_number(max_steps) and max_steps > 0:
        share = min(step / max_steps, 1.0)
        items.append(_item("Steps", f"{step:,} of {max_steps:,} ({share:.0%})",
                           f'<div class="bar"><span style="width:{share * 100:.1f}%"></span></div>'))
    else:
        items.append(_item("Steps", f"{step:,}"))
    samples = metrics.last("samples") if metrics.last("samples") is not None else meta.get("samples")
    items.append(_item("Samples seen", _num(samples) if samples is not None else "&ndash;"))
    return items


def _metric_items(run: Run) -> list[str]:
    metrics = run.metrics
    loss, rate = metrics.last("loss"), metrics.series("img_per_s")
    items = [_item("Last loss", _num(loss) if loss is not None else "&ndash;")]
    if rate:
        # The interval holding a checkpoint's save and validation reads slow; the median is the steady speed.
        median = statistics.median(v for _, v in rate)
        items.append(_item("Images / s", f"{rate[-1][1]:.3g} last, {median:.3g} median"))
    timing = _training_seconds(metrics)
    if timing:
        seconds, estimated = timing
        items.append(_item("Training time", ("&asymp; " if estimated else "") + _duration(seconds)))
    return items


def _setup_items(run: Run) -> list[str]:
    meta = _newest_meta(run)
    tuning = meta.get("tuning") or {}
    train = _section(run.config, "train")
    if tuning:
        precision = f"{tuning.get('precision')} ({tuning.get('precision_source')})"
        if tuning.get("fp32_ms") and tuning.get("bf16_ms"):
            precision += f"; measured fp32 {tuning['fp32_ms']:.0f} ms vs bf16 {tuning['bf16_ms']:.0f} ms"
        checkpointing = "on" if tuning.get("checkpointing") else "off"
    else:
        precision = f"{train.get('mixed_precision', '?')} (config; no checkpoint yet)"
        checkpointing = str(train.get("gradient_checkpointing", "?"))
    items = [_item("Precision", html.escape(precision)), _item("Gradient checkpointing", html.escape(checkpointing))]
    steps = [meta.get("step") for _, meta in run.checkpoints if meta]
    newest = f", newest at step {steps[-1]:,}" if steps else ""
    items.append(_item("Checkpoints", f"{len(run.checkpoints)}{newest}" if run.checkpoints else "none yet"))
    if run.world_size and run.world_size > 1:
        strategy = _section(run.config, "parallel").get("strategy", "?")
        items.append(_item("Processes", f"{run.world_size} ({html.escape(str(strategy))})"))
    return items


def _notes(run: Run) -> str:
    metrics, notes = run.metrics, []
    if metrics.restarts:
        notes.append(f"The run restarted {metrics.restarts} time(s): steps logged again after a resume show "
                     "their last logged values.")
    if metrics.unreadable:
        notes.append(f"{metrics.unreadable} unreadable line(s) of metrics.jsonl skipped (a run stopped mid-write "
                     "leaves one).")
    if run.later_configs:
        names = ", ".join(p.name for p in run.later_configs)
        notes.append(f"The config changed at a restart ({html.escape(names)}); the newest is used here.")
    return "".join(f'<p class="muted">{n}</p>' for n in notes)


def _legend(keys: list[str]) -> str:
    if len(keys) < 2:
        return ""
    spans = (f'<span class="key"><i style="background:{_PALETTE[i % len(_PALETTE)]}"></i>{html.escape(k)}</span>'
             for i, k in enumerate(keys))
    return f"<figcaption>{''.join(spans)}</figcaption>"


def _plots_html(metrics: Metrics) -> str:
    if not metrics.records:
        return '<p class="muted">No metrics logged yet (metrics.jsonl is missing or empty).</p>'
    parts, section = [], None
    for group in metric_groups(metrics.keys()):
        if group.section != section:
            # Bookkeeping counters rarely need a close look: smaller plots, after the ones that do.
            size = " small" if group.section == "Progress" else ""
            parts.append(("</div>" if section else "") + f'<h3>{group.section}</h3><div class="plots{size}">')
            section = group.section
        parts.append(f'<figure><h3>{html.escape(group.title)}</h3>{plot_svg(group, metrics)}'
                     f"{_legend(group.keys)}</figure>")
    parts.append("</div>")
    count = len(metrics.records)
    first, last = metrics.records[0]["step"], metrics.records[-1]["step"]
    span = f"step {first:,}" if count == 1 else f"steps {first:,} to {last:,}"
    return f'<p class="muted">{count:,} logged step(s), {span}. Hover a point for its value.</p>' + "".join(parts)


def _data_uri(path: Path) -> str:
    from PIL import Image

    data = path.read_bytes()
    mime = "image/png"
    if len(data) > _IMAGE_MAX_BYTES:
        with Image.open(io.BytesIO(data)) as image:
            image = image.convert("RGB")
            if image.width > _IMAGE_MAX_WIDTH:
                image = image.resize((_IMAGE_MAX_WIDTH, round(image.height * _IMAGE_MAX_WIDTH / image.width)))
            out = io.BytesIO()
            image.save(out, format="JPEG", quality=88)
            data, mime = out.getvalue(), "image/jpeg"
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def _display_size(path: Path) -> str:
    """Width and class for an <img>: a tiny run's grid of 32 px tiles is unreadable at its natural size."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            width, height = image.size
    except OSError:
        return ""
    scale = max(1, 480 // max(width, 1))
    upscaled = ' class="upscaled"' if scale > 1 else ""
    return f'width="{width * scale}" height="{height * scale}"{upscaled}'


def shown_samples(samples: list[tuple[int, Path]], limit: int = MAX_IMAGES) -> list[tuple[int, Path]]:
    """The newest `limit` grids and the first, so a long run shows where it started and where it is."""
    if len(samples) <= limit + 1:
        return samples
    return [*samples[:limit], samples[-1]]


def _gallery_html(run: Run, limit: int) -> str:
    if not run.samples:
        return ('<p class="muted">No validation grids yet: they are written to samples/ at each checkpoint '
                "when validation.prompts is set.</p>")
    shown = shown_samples(run.samples, limit)
    note = (f"Showing {len(shown)} of {len(run.samples)} grids: the {limit} newest and the first."
            if len(shown) < len(run.samples) else f"{len(shown)} grid(s), newest first.")
    figures = []
    for step, path in shown:
        label = f"step {step:,}"
        figures.append(f'<figure data-label="{label}"><figcaption>{label} &middot; samples/{html.escape(path.name)}'
                       f'</figcaption><img src="{_data_uri(path)}" {_display_size(path)} '
                       f'alt="validation grid at {label}"></figure>')
    # The slider runs oldest to newest, left to right; it starts at the newest.
    controls = (f'<div class="controls"><input type="range" id="slider" min="0" max="{len(shown) - 1}" '
                f'value="{len(shown) - 1}" aria-label="grid"><span id="slide-label"></span>'
                '<label><input type="checkbox" id="show-all"> show all</label></div>') if len(shown) > 1 else ""
    return f'<p class="muted">{note}</p>{controls}<div class="gallery">{"".join(figures)}</div>'


def _first_batch_html(run: Run) -> str:
    path = run.path / FIRST_BATCH
    if not path.is_file():
        return ('<p class="muted">No first batch: it is drawn at a run\'s first step when it trains on images (not on '
                "pre-encoded latents); `sdtrain data preview CONFIG` draws the same from any config.</p>")
    return (f'<figure><figcaption>the first batch as the model received it &middot; {FIRST_BATCH}'
            f'</figcaption><img src="{_data_uri(path)}" {_display_size(path)} alt="first training batch"></figure>')


def _dir_size(path: Path) -> str:
    try:
        return f"{sum(p.stat().st_size for p in path.rglob('*') if p.is_file()) / 2**20:,.1f} MiB"
    except OSError:
        return "?"  # removed under us: a training run keeps only its last few checkpoints


def _checkpoints_html(run: Run) -> str:
    if not run.checkpoints:
        return '<p class="muted">None yet.</p>'
    rows = []
    for folder, meta in reversed(run.checkpoints):
        meta = meta or {}
        tuning = meta.get("tuning") or {}
        rows.append(f"<tr><td><code>{html.escape(folder.name)}</code></td><td>{_num(meta.get('step', '?'))}</td>"
                    f"<td>{_num(meta.get('samples', '?'))}</td><td>{html.escape(str(tuning.get('precision', '?')))}"
                    f"</td><td>{'yes' if meta.get('ema') else 'no'}</td><td>{_dir_size(folder)}</td>"
                    "</tr>")
    return ("<table><tr><th>folder</th><th>step</th><th>samples</th><th>precision</th><th>EMA</th><th>size</th>"
            f"</tr>{''.join(rows)}</table>")


def _config_html(run: Run) -> str:
    if run.config_text is None:
        return '<p class="muted">No config.yaml in the run folder.</p>'
    name = run.later_configs[-1].name if run.later_configs else "config.yaml"
    return (f"<details><summary>{html.escape(name)} (the resolved config)</summary>"
            f"<pre>{html.escape(run.config_text)}</pre></details>")


def _environment_html(run: Run) -> str:
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in environment())
    world = run.world_size
    ranks = f"<tr><th>Ranks</th><td>{world} (from the newest checkpoint)</td></tr>" if world else ""
    return ('<p class="muted">Where this report was written; the run records only its ranks.</p>'
            f"<table>{rows}{ranks}</table>")


def render(run: Run, images: int = MAX_IMAGES) -> str:
    judged = verdict(run.metrics)
    sections = [("summary", "Summary"), ("metrics", "Metrics"), ("samples", "Samples"), ("data", "Data"),
                ("checkpoints", "Checkpoints"), ("config", "Config"), ("environment", "Environment")]
    return _PAGE.substitute(
        title=html.escape(f"{run.path.name} · sdtrain report"),
        heading=html.escape(f"Run {run.path.name}"),
        path=html.escape(str(run.path.resolve())),
        written=time.strftime("%Y-%m-%d %H:%M"),
        version=html.escape(__version__),
        nav="".join(f'<a href="#{anchor}">{name}</a>' for anchor, name in sections),
        verdict_level=judged.level,
        verdict_label=_VERDICT_LABELS[judged.level],
        verdict_text=html.escape(judged.text),
        summary="".join([*_progress_items(run), *_metric_items(run), *_setup_items(run)]),
        notes=_notes(run),
        plots=_plots_html(run.metrics),
        gallery=_gallery_html(run, images),
        data=_first_batch_html(run),
        checkpoints=_checkpoints_html(run),
        config=_config_html(run),
        environment=_environment_html(run),
    )


def write_report(run_dir: Path, out: Path | None = None, images: int = MAX_IMAGES) -> Path:
    """Write the run's report (default RUN/report.html) whole or not at all; returns its path."""
    from sdtrain.utils import atomic_write_text  # torch and PIL: the report module itself loads none

    run = load_run(Path(run_dir))
    out = Path(out) if out is not None else run.path / "report.html"
    page = render(run, images)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, page)
    except OSError as exc:
        raise UserError(f"--out: cannot write {out} ({exc.strerror}); choose a writable path") from exc
    return out
