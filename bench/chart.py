"""Charts of a benchmark run, for docs/benchmarks.md, drawn from what the run wrote.

  chart.py drain   target/bench/claim.md       -> docs/images/bench-drain.png
  chart.py deliver target/bench/deliver.json   -> docs/images/bench-latency.png, bench-kafka.png

bench/claim.sh and bench/deliver.sh call it at their end; rerun it by hand to redraw."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

IMAGES = Path(__file__).resolve().parent.parent / "docs/images"
COLORS = {"ours": "#2b6cb0", "ours2": "#63b3ed", "ours3": "#e53e3e", "peer": "#718096", "peer2": "#a0aec0",
          "floor": "#2d3748"}


def grouped_bars(ax, groups: list[str], series: list[tuple[str, list[float], str]], log: bool = False) -> None:
    width = 0.8 / len(series)
    for i, (label, values, color) in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=label, color=color)
    ax.set_xticks(range(len(groups)), groups)
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncols=3)


def per_second(ax) -> None:
    ax.set_ylabel("events/s")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1000:,.0f}k"))


def save(fig, name: str) -> None:
    fig.tight_layout()
    fig.savefig(IMAGES / name, dpi=100)
    print(f"drew docs/images/{name}")


def drain(report: Path) -> None:
    """The drain table of bench/claim.sh: rates by batch size and relay count."""
    rows = [[c.strip() for c in line.strip("|\n").split("|")]
            for line in report.read_text().splitlines()
            if re.match(r"\| (100|1000) \|", line)]
    groups = [f"batch {r[0]}, {r[1]} relay{'s' if r[1] != '1' else ''}" for r in rows]
    col = lambda i: [float(r[i]) for r in rows]  # noqa: E731
    fig, ax = plt.subplots(figsize=(10, 4.2))
    grouped_bars(ax, groups, [
        ("outbox_ext claim + settle", col(2), COLORS["ours"]),
        ("outbox_ext settle_and_claim", col(3), COLORS["ours2"]),
        ("outbox_ext, 5% failing", col(4), COLORS["ours3"]),
        ("plain-SQL relay", col(5), COLORS["peer2"]),
        ("PgQ 3.5", col(6), COLORS["peer"]),
        ("floor", col(7), COLORS["floor"]),
    ])
    per_second(ax)
    ax.set_title("Draining 300,000 events (bench/claim.sh)", fontsize=10)
    save(fig, "bench-drain.png")


def deliver(results: Path) -> None:
    r = json.loads(results.read_text())
    if "http_latency" in r or "kafka_latency" in r:
        latency(r)
    if "kafka_native" in r:
        kafka(r["kafka_native"])


def latency(r: dict) -> None:
    """Commit-to-sink (HTTP) and commit-to-consumer (Kafka) percentiles at 1,000 events/s."""
    who = []
    if "http_latency" in r:
        who += [("webhook: outbox_ext worker", r["http_latency"]["worker"], COLORS["ours"]),
                ("webhook: 100 ms polling relay", r["http_latency"]["polling_relay"], COLORS["peer2"])]
    if "kafka_latency" in r:
        k = r["kafka_latency"]
        who += [("Kafka: outbox_ext native sink", k["native"], COLORS["ours2"]),
                ("Kafka: plain producer", k["producer"], COLORS["peer"]),
                ("Kafka: Debezium outbox router", k["debezium"], COLORS["floor"])]
    groups = ["p50", "p99", "p999"]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    grouped_bars(ax, groups, [(label, [lat[g] for g in groups], color) for label, lat, color in who], log=True)
    ax.set_ylabel("ms (log scale)")
    ax.set_title("Latency at 1,000 events/s, one event per transaction (bench/deliver.sh)", fontsize=10)
    save(fig, "bench-latency.png")


def kafka(k: dict) -> None:
    """The native sink's drain rates against the plain producer's ceiling and Debezium."""
    runs = k["runs"]
    groups = [f"{run['keys']:,} keys\nbatch {run['batch']:,}" for run in runs]
    series = [("outbox_ext native sink", [run["rate"] for run in runs], COLORS["ours"]),
              ("plain producer (ceiling)", [run["ceiling"] for run in runs], COLORS["peer"])]
    if "debezium_100000" in k:
        series.append(("Debezium outbox router", [k[f"debezium_{run['keys']}"] for run in runs], COLORS["floor"]))
    fig, ax = plt.subplots(figsize=(10, 4.2))
    grouped_bars(ax, groups, series)
    per_second(ax)
    ax.set_title(f"Kafka, 3 brokers, RF 3, acks=all: draining {k['events']:,} events (bench/deliver.sh)",
                 fontsize=10)
    save(fig, "bench-kafka.png")


if __name__ == "__main__":
    {"drain": drain, "deliver": deliver}[sys.argv[1]](Path(sys.argv[2]))
