"""The table, the JSON and the chart of a bench run."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from bench.harness import Row


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": list(os.getloadavg()),
    }


def _num(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    if unit in ("us", "ms", "B", "writes"):
        return f"{x:,.1f}"
    return f"{x:,.0f}"


def table(rows: list[Row], beside: str = "beside") -> str:
    """A plain-text table (also valid Markdown). A reference that is a fixed target rather
    than a measurement reads ``(target)``. Rows measured beside another commit's node
    (``--beside``, named ``beside``) add its figure, its ratio and ours against it."""
    with_beside = any(r.beside is not None for r in rows)
    head = [
        "scenario",
        "metric",
        "ours",
        "reference",
        "ratio",
        "target",
        "met?",
        "pure",
        "pure ratio",
        *((beside, f"{beside} ratio", f"ours/{beside}") if with_beside else ()),
    ]
    lines = [head]
    for r in rows:
        met = "n/a" if r.met is None else ("yes" if r.met else "NO")
        if r.ours is None and r.detail.get("status"):
            met = str(r.detail["status"])[:40]
        lines.append(
            [
                r.scenario,
                f"{r.metric} [{r.unit}]",
                _num(r.ours, r.unit),
                _num(r.reference, r.unit) + (" (target)" if r.reference_kind == "target" else ""),
                "-" if r.ratio is None else f"{r.ratio:.3g}x",
                r.target,
                met,
                "-" if r.pure is None else _num(r.pure, r.unit),
                "-" if r.pure_ratio is None else f"{r.pure_ratio:.3g}x",
                *(
                    (
                        "-" if r.beside is None else _num(r.beside, r.unit),
                        "-" if r.beside_ratio is None else f"{r.beside_ratio:.3g}x",
                        "-" if r.vs_beside is None else f"{r.vs_beside:.3g}x",
                    )
                    if with_beside
                    else ()
                ),
            ]
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = []
    for n, row in enumerate(lines):
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if n == 0:
            out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def write_json(doc: dict[str, Any], results_dir: Path) -> tuple[Path, Path]:
    """``<results_dir>/<timestamp>.json`` and ``latest.json``."""
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = results_dir / f"{stamp}-{doc['mode']}.json"
    text = json.dumps(doc, indent=2, sort_keys=False) + "\n"
    path.write_text(text)
    latest = results_dir / "latest.json"
    latest.write_text(text)
    return path, latest


def chart(rows: list[Row], path: Path, title: str) -> Path:
    """Throughput (ours vs reference, log scale) and latency (p50/p99) per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thr = [r for r in rows if r.unit in ("ops/s", "incr/s", "events/s", "keys/s") and r.ours]
    lat = [r for r in rows if r.scenario.startswith("1 ") and r.unit == "ops/s"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [3, 2]})
    labels = [r.metric.replace(" vs ", "\nvs ").replace(", ", "\n", 1) for r in thr]
    xs = range(len(thr))
    ax1.bar([x - 0.2 for x in xs], [r.ours or 0 for r in thr], 0.4, label="meter")
    ax1.bar([x + 0.2 for x in xs], [r.reference or 0 for r in thr], 0.4, label="reference")
    for x, r in zip(xs, thr, strict=True):
        if r.ratio is not None:
            ax1.annotate(
                f"{r.ratio:.2g}x",
                (x, max(r.ours or 0, r.reference or 0)),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax1.set_yscale("log")
    ax1.set_xticks(list(xs))
    ax1.set_xticklabels(labels, fontsize=6.5, rotation=60, ha="right")
    ax1.set_ylabel("per second (log)")
    ax1.set_title("Throughput: meter vs reference (ratio above)")
    ax1.legend()
    if lat:
        names = [f"{r.detail['connections']}c d{r.detail['depth']}" for r in lat]
        xl = range(len(lat))
        w = 0.2
        series = [
            ("ours_p50_us", "meter p50"),
            ("redis_p50_us", "redis p50"),
            ("ours_p99_us", "meter p99"),
            ("redis_p99_us", "redis p99"),
        ]
        for i, (k, lab) in enumerate(series):
            ax2.bar([x + (i - 1.5) * w for x in xl], [r.detail[k] for r in lat], w, label=lab)
        ax2.set_yscale("log")
        ax2.set_xticks(list(xl))
        ax2.set_xticklabels(names)
        ax2.set_ylabel("round-trip latency, us (log)")
        ax2.set_title("track vs INCR latency (batch round trip)")
        ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
