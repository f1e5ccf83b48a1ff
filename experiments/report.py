"""Tables, findings and curves from a sweep's results folders (it reads nothing else).

    python -m experiments.report fedawe-table2 --results results/fedawe-table2 --out reports/fedawe_table2
    python -m experiments.report --study my_study.toml --results results/my-study --out reports/my_study

writes ``<out>.md``, ``<out>.json`` (every number the text states) and ``<out>-curves.png``.
Every number and every sentence that states a number or an ordering is computed from the runs
found in the results folder (any seeds, any ``--set`` overrides: their config.json says what
ran); the only fixed text is the study's ``notes`` (citation and the paper's setup). The setup
differences are computed too: the preset's ``paper_setup`` against the runs' configs.

A study that declares claims (the paper presets) gets a verdict on each; any other study is a
plain comparison: the table, the curves, per-seed values with 95% confidence intervals, the
orderings and seed-paired gaps. "Regenerate" gives the exact commands that made the results (from
the sweep log) and this report.

Summary of a run: the mean of the metric over its evaluations in the last 10% of its rounds
(``--fraction``), over its last K evaluations (``--last K``), or over the first fraction of
its rounds (``--early``: how fast the rules learn); the report says how many evaluations were
averaged. A rule whose runs also recorded ``<metric>-xbar`` (FedAWE: the mean of all clients'
copies, which its official code scores) gets a second, labelled row.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

import numpy as np

from experiments.study import Sweep
from experiments.summary import XBAR, Cell, Window, collect, columns_of, find_runs, summarise, verdict_word
from server_app import checkpoint
from server_app.results import integer_ticks


def render(sweep: Sweep, s: dict[str, Any], curves_name: str, extra: list[str]) -> str:
    rounds, seeds = s["rounds"], s["seeds"]
    lines = [f"# {sweep.name}", "", sweep.notes.strip(), ""]
    if not s["runs-found"]:
        return "\n".join([*lines, "No finished runs found."]) + "\n"
    clock = ("as `experiments.sweep` measured it" if s["wall-time-source"] == "sweep"
             else "the runs' own round-loop clock")
    lines += [f"Runs found: {s['runs-found']} (the study has {s['runs-per-seed']} combinations; seeds found: "
              f"{', '.join(map(str, seeds))}); rounds per run: {', '.join(map(str, rounds))}; wall time per run "
              f"{s['wall-time-per-run']} s on average ({clock}).", ""]
    if s["sweep-invocations"]:
        lines += [f"Sweep wall time: {s['sweep-wall-minutes']:.1f} min for {s['sweep-runs-done']} runs in {len(s['sweep-invocations'])} "
                  f"invocation(s) of `experiments.sweep` with "
                  f"{'/'.join(sorted({str(i['workers']) for i in s['sweep-invocations']}))} worker(s) on "
                  f"{'/'.join(sorted({str(i['cpus']) for i in s['sweep-invocations']}))} CPU(s).", ""]
    row_axis, d = list(sweep.axes)[-1], s["digits"]
    lines += [f"| {row_axis} | " + " | ".join(s["columns"]) + " |", "|" + "---|" * (len(s["columns"]) + 1)]
    labels = list(dict.fromkeys(e["label"] for c in s["columns"].values() for e in c["entries"]))
    for label in labels:
        cells = []
        for col in s["columns"].values():
            e = next((e for e in col["entries"] if e["label"] == label), None)
            spread = f" ± {e['std']:.{d}f}" if e and e["n"] > 1 else ""
            cells.append("–" if e is None else f"{e['mean']:.{d}f}{spread} (n={e['n']})"
                         + (f" [paper {e['paper']}]" if e["paper"] is not None else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    legend = (f"{s['metric']} × {s['scale']:g}, {s['window']}; mean ± std over seeds (n = seeds). Gaps between "
              "rules are compared seed by seed: a seed fixes the data split, the schedule and the training seeds.")
    if any(label.endswith("[x̄]") for label in labels):
        legend += (" A row marked [x̄] scores the mean of all clients' copies (`" + s["metric"] + XBAR + "`), the "
                   "model FedAWE's official code scores; the row above it scores the global model x^t. Where a "
                   "rule has an [x̄] row, the paper's number stands beside it.")
    lines += ["", legend, "", f"![curves]({curves_name})", "", *render_seeds(s), *render_verdicts(s), *render_privacy(s), *extra,
              "## What the numbers show", ""]
    better = "higher" if s["higher-is-better"] else "lower"
    for name, col in s["columns"].items():
        if not col["entries"]:
            continue
        means = {e["label"]: e["mean"] for e in col["entries"]}
        order = (" > " if s["higher-is-better"] else " < ").join(f"{r} {means[r]:.{d}f}" for r in col["ranking"])
        lines.append(f"- **{name}** ({better} is better): {order}.")
        for g in col["gaps"]:
            spread = ("one seed: no spread measured" if g["seeds"] < 2 else "the order flips between seeds"
                      if g["order"] == "mixed" else f"the same order in all {g['seeds']} seeds")
            lines.append(f"  - {g['between'][0]} vs {g['between'][1]}: {g['gap']:.{d}f} apart ({spread}).")
        if col["paper-pairs"]:
            lines.append(f"  - Paper: {col['paper-pairs-agree']} of {col['paper-pairs']} pairs ordered as in the paper"
                         + ("." if not col["paper-disagree"] else "; not: "
                            + ", ".join(f"{a} vs {b}" for a, b in col["paper-disagree"]) + "."))
    lines += ["", "## Setup", ""]
    if sweep.paper_setup:
        lines += ["Setup differences from the paper (the preset's paper setup vs these runs' configs):", ""]
        lines += [f"- `{k}`: paper `{v['paper']}`, here `{'`, `'.join(v['ours'])}`"
                  for k, v in s["differs-from-paper"].items()] or ["- none"]
    lines += ["", "Run config keys that vary between runs: "
              + (", ".join(f"`{k}` ({' / '.join(v)})" for k, v in s["setup-varying"].items()) or "none") + ".", "",
              "Run config keys shared by all runs:", "", "| key | value |", "|---|---|",
              *[f"| `{k}` | `{v}` |" for k, v in s["setup"].items()], "",
              f"Regenerate ({s.get('regenerate-from', 'from the repository root')}):", "", "```", *s["regenerate"],
              "```"]
    return "\n".join(lines) + "\n"


def render_seeds(s: dict[str, Any]) -> list[str]:
    """Per-seed values and the 95% confidence interval of each mean (Student's t over seeds)."""
    d = s["digits"]
    lines = ["## Per seed", "", "| column | row | " + " | ".join(f"seed {k}" for k in s["seeds"])
             + " | mean | 95% CI |", "|" + "---|" * (len(s["seeds"]) + 4)]
    for name, col in s["columns"].items():
        for e in col["entries"]:
            values = [str(e["seeds"][str(k)]) if str(k) in e["seeds"] else "–" for k in s["seeds"]]
            ci = "–" if e["ci95"] is None else f"[{e['ci95'][0]:.{d}f}, {e['ci95'][1]:.{d}f}]"
            lines.append(f"| {name} | {e['label']} | " + " | ".join(values) + f" | {e['mean']:.{d}f} | {ci} |")
    return [*lines, ""]


def render_privacy(s: dict[str, Any]) -> list[str]:
    """The (ε, δ) each cell's DP runs ended with (run config dp-*, docs/privacy.md)."""
    if not s.get("privacy"):
        return []
    lines = ["## Privacy", "", "| cell | participants per round | noise multiplier | ε (Poisson at q_t = m_t/N) | "
             "ε, worst client (no amplification) | δ | rounds | seeds |", "|---|---|---|---|---|---|---|---|"]
    for cell, p in s["privacy"].items():
        lines.append(f"| {cell} | {p['participants-per-round']:.1f} | {p['dp-noise-multiplier']:g} | "
                     f"{p['dp-epsilon']:.2f} | {p['dp-epsilon-worst-client']:.2f} | {p['dp-delta']:g} | "
                     f"{', '.join(map(str, p['rounds']))} | {p['seeds']} |")
    return [*lines, "", "ε after the last round, mean over seeds. The first assumes each client's presence in a "
            "round is an independent draw at the realised rate, which churn does not guarantee; the second holds "
            "whatever decided participation, if not the clients' data (docs/privacy.md).", ""]


def render_verdicts(s: dict[str, Any]) -> list[str]:
    if not s["verdicts"]:
        return []
    d, told = s["digits"], set()
    lines = ["## The paper's claims", ""]
    for v in s["verdicts"]:
        test = "ahead in every seed" if v["within"] is None else f"no more than {v['within']:g} behind on average"
        lines.append(f"- **{v['verdict']}**: {v['claim']} ({v['rule']} {test} in {v['held']} of "
                     f"{len(v['comparisons'])} comparisons).")
        for c in v["comparisons"]:
            paper = "" if c["paper-gap"] is None else f"; paper {c['paper-gap']:+.1f}"
            seeds = ", ".join(f"{g:+.{d + 1}f}" for g in c["per-seed"])
            lines.append(f"  - {c['column']}, {v['rule']} vs {c['other']}: {c['gap']:+.{d}f} in {v['rule']}'s favour "
                         f"(per seed {seeds}: ahead in {c['seeds-ahead']} of {len(c['per-seed'])}{paper})")
        if v["why"] and v["verdict"] != "reproduced":
            lines.append(f"  - Why: {'see above.' if v['why'] in told else v['why']}")
            told.add(v["why"])
    return [*lines, ""]


def plot_curves(sweep: Sweep, table: dict[tuple[str, ...], Cell], metric: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = columns_of(sweep)
    fig, panels = plt.subplots(1, len(cols), figsize=(4.5 * len(cols), 3.6), squeeze=False)
    for ax, col in zip(panels[0], cols, strict=True):
        for row in list(sweep.axes.values())[-1]:
            cell = table.get((*col, row))
            if cell is None:
                continue
            n = min(len(c[1]) for c in cell.curves)
            line, = ax.plot(cell.curves[0][0][:n], np.mean([c[1][:n] for c in cell.curves], axis=0), label=row)
            m = min(len(c[2]) for c in cell.curves)
            if m:
                ax.plot(cell.curves[0][0][:m], np.mean([c[2][:m] for c in cell.curves], axis=0), "--",
                        color=line.get_color(), label=f"{row} [x̄]")
        ax.set_title(" / ".join(col) or sweep.name, fontsize=9)
        ax.set_xlabel("round")
        integer_ticks(ax.xaxis)
        ax.set_ylabel(f"{metric} (mean over seeds)")
        ax.grid(alpha=0.3)
    panels[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fdms_similarity(sweep: Sweep, results: Path, out: Path) -> list[str]:
    """FL-FDMS's similarity matrix R at its last checkpoint, per dropout ratio, lowest seed found."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from strategies import STRATEGIES
    from workloads.partition import cluster_of

    panels = []
    for labels, runs in find_runs(sweep, results).items():
        if "fl-fdms" not in labels:
            continue
        seed = min(runs)
        ckpts = sorted((runs[seed] / "checkpoints").glob("round-*.pt"))
        if ckpts:
            ckpt = checkpoint.load(ckpts[-1])
            config = ckpt["config"]
            panels.append((labels[0], seed, ckpt["round"], np.asarray(STRATEGIES["fl-fdms"].read_state(ckpt["strategy"]).R),
                           cluster_of(config["partition"], config["num-clients"])))
    if not panels:
        return []
    fig, axes = plt.subplots(1, len(panels), figsize=(3.8 * len(panels), 3.4), squeeze=False)
    for ax, (title, seed, rnd, matrix, _) in zip(axes[0], panels, strict=True):
        image = ax.imshow(matrix, vmin=0, vmax=1, cmap="viridis")
        ax.set_title(f"FL-FDMS R, {title}, seed {seed}, round {rnd}", fontsize=8)
        ax.set_xlabel("client id")
        ax.set_ylabel("client id")
        integer_ticks(ax.xaxis, ax.yaxis)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    path = out.with_name(out.name + "-similarity.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    lines, recovered, clients = ["## Friend discovery", "", f"![similarity]({path.name})", ""], 0, 0
    for title, seed, rnd, matrix, clusters in panels:
        if clusters is None:
            continue
        same = clusters[:, None] == clusters[None, :]
        np.fill_diagonal(same, False)
        off = ~same
        np.fill_diagonal(off, False)
        nearest = np.where(np.eye(len(matrix), dtype=bool), -np.inf, matrix).argmax(axis=1)
        found = int((clusters[nearest] == clusters).sum())
        recovered, clients = recovered + found, clients + len(matrix)
        lines.append(f"- {title} (seed {seed}, round {rnd}): mean R within a cluster {matrix[same].mean():.2f}, "
                     f"between clusters {matrix[off].mean():.2f}; {found} of {len(matrix)} clients' "
                     f"most similar client (their friend when dropped) is in their own cluster.")
    if clients:
        lines.append(f"- **{verdict_word(recovered, clients)}**: FL-FDMS's similarities R recover the clusters "
                     f"({recovered} of {clients} most-similar clients in the same cluster).")
    return [*lines, ""]


FIGURES = {"fdms-similarity": fdms_similarity}


def report_command(study: str, results: Path, out: Path, metric: str, window: Window) -> str:
    """The command line that writes this report again."""
    args = ["python", "-m", "experiments.report", "--study", study, "--results", str(results), "--out", str(out)]
    if metric != "test-accuracy":
        args += ["--metric", metric]
    if window.evals:
        args += ["--last", str(window.evals)]
    elif window.fraction != Window().fraction:
        args += ["--fraction", f"{window.fraction:g}"]
    if window.early:
        args.append("--early")
    return shlex.join(args)


def regenerate_from(study: str) -> str:
    """Where the Regenerate commands run: the repository root for a preset or a study file inside
    the repository; otherwise the folder the sweep was started in (the study file and the
    folders as that command gave them), with flchurn installed."""
    from runconfig.defaults import ROOT

    path = Path(study).expanduser()
    if not path.is_file():
        return "from the repository root" if ":" not in study or study.startswith("experiments.") else (
            "from the folder the sweep was started in, with flchurn installed and the study's module importable")
    try:
        path.resolve().relative_to(ROOT)
        return "from the repository root"
    except ValueError:
        return (f"from the folder the sweep was started in (the study file {study!r} is outside the "
                "repository; its paths below are as that command gave them), with flchurn installed")


def write_report(sweep: Sweep, results: Path, out: Path, metric: str = "test-accuracy",
                 window: Window | None = None, study: str | None = None) -> Path:
    """Write ``out``.md/.json/-curves.png; ``study`` is how the study was named (for Regenerate)."""
    window = window or Window()
    summary = summarise(sweep, results, metric, window)
    ref = study or sweep.name
    summary["regenerate"] = [*(summary["sweep-commands"] or [shlex.join(
        ["python", "-m", "experiments.sweep", "--study", ref, "--out", str(results)])]),
        report_command(ref, results, out, metric, window)]
    summary["regenerate-from"] = regenerate_from(ref)
    out.parent.mkdir(parents=True, exist_ok=True)
    curves = out.with_name(out.name + "-curves.png")
    table = collect(sweep, results, metric, window, summary["scale"])
    extra = []
    if table:
        plot_curves(sweep, table, metric, curves)
        extra = [line for fig in sweep.figures for line in FIGURES[fig](sweep, results, out)]
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    path = out.with_suffix(".md")
    path.write_text(render(sweep, summary, curves.name, extra))
    return path


def main(argv: list[str] | None = None) -> int:
    from experiments.sweep import study_argument, study_of

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    study_argument(parser)
    parser.add_argument("--results", default=None, help="the sweep's results folder (default results/<study name>)")
    parser.add_argument("--out", default=None, help="the report's path without suffix (default reports/<name>)")
    parser.add_argument("--metric", default="test-accuracy")
    parser.add_argument("--fraction", type=float, default=0.1,
                        help="summarise a run by its evaluations in the last FRACTION of its rounds")
    parser.add_argument("--last", type=int, default=0, help="instead: its last K evaluations")
    parser.add_argument("--early", action="store_true",
                        help="instead: its evaluations in the FIRST fraction of its rounds (how fast rules learn)")
    args = parser.parse_args(argv)
    if not 0 < args.fraction <= 1 or args.last < 0:
        parser.error(f"--fraction must be in (0, 1] and --last >= 0; got {args.fraction}, {args.last}")
    ref, sweep = study_of(parser, args)
    path = write_report(sweep, Path(args.results or f"results/{sweep.name}"),
                        Path(args.out or f"reports/{sweep.name.replace('-', '_')}"), args.metric,
                        Window(args.fraction, args.last, args.early), study=ref)
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
