"""``kiln rl report``: one PNG from the records of learning runs (``LearningRun``): reward and greedy accuracy against
wall-clock per run (async and sync side by side), the lag histogram (versions between a sample's first token and the
step that trained on it) and the fraction of the run that decoding stood still for weight updates."""

from __future__ import annotations

from pathlib import Path

from kiln.rl.local import RunRecord


def lag_histogram(record: RunRecord) -> dict[int, int]:
    total: dict[int, int] = {}
    for _t, update in record.updates:
        for lag, count in update.lag_histogram.items():
            total[lag] = total.get(lag, 0) + count
    return dict(sorted(total.items()))


def paused_fraction(record: RunRecord) -> float:
    return record.paused_s / record.wall_s if record.wall_s else 0.0


def write_report(records: list[RunRecord], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on workers or CI
    import matplotlib.pyplot as plt

    figure, (learning, lags, pauses) = plt.subplots(1, 3, figsize=(16, 4.5))
    for record in records:
        name = record.config.name
        line = learning.plot([e.t for e in record.evaluations], [e.accuracy for e in record.evaluations],
                             label=f"{name}: greedy accuracy")[0]
        learning.plot([t for t, _u in record.updates], [u.reward_mean for _t, u in record.updates], linestyle=":",
                      color=line.get_color(), label=f"{name}: training reward")
        histogram = lag_histogram(record)
        samples = sum(histogram.values()) or 1
        lags.bar([lag + (0.2 if record.config.sync else -0.2) for lag in histogram],
                 [count / samples for count in histogram.values()], width=0.4, label=name)
    if records and records[0].config.target is not None:
        learning.axhline(records[0].config.target, color="grey", linewidth=0.8, label="target")
    learning.set(xlabel="wall-clock (s)", ylabel="accuracy / reward", title="Learning")
    learning.legend(fontsize=8)
    lags.set(xlabel="lag (policy versions)", ylabel="share of samples", title="Sample lag")
    lags.legend(fontsize=8)
    pauses.bar([r.config.name for r in records], [paused_fraction(r) for r in records])
    pauses.set(ylabel="fraction of wall-clock", title="Decoding paused for weight updates")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out
