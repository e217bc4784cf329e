"""card-check's report a person reads, beside its JSON: one table per switch of the engine A/B
(each setting's decode step per batch, compile time, TTFT per context, one-stream tokens per second,
accepted length, where its greedy tokens left the recipe's), the premise rows' verdicts, and a plot
of the batch-1 decode step per setting. The plot is an SVG bar chart written here: the port image
installs the plugin without dependencies (ports/beam-1-0/install.sh), so card-check cannot count on
a plotting library on the node."""

from __future__ import annotations

from pathlib import Path
from xml.sax.saxutils import escape

REPORT = "card-check.md"
PLOT = "step-time.svg"


def _ms(value) -> str:
    return "failed" if value is None else f"{value:.2f}"


def switch_table(verdict: dict) -> list[str]:
    figures = {name: f for name, f in verdict["figures"].items() if isinstance(f, dict)}
    names = list(figures)
    batches = sorted({int(b) for f in figures.values() for b in f.get("step_ms", {})})
    contexts = sorted({int(c) for f in figures.values() for c in f.get("ttft_ms", {})})
    header = (["setting"] + [f"decode ms, batch {b}" for b in batches] + [f"compile ms, batch {b}" for b in batches]
              + [f"TTFT ms, {c} tokens" for c in contexts]
              + ["start to first token, s", "tok/s, 1 stream", "accepted length", "greedy tokens"])
    lines = [f"### {verdict['switch']}: {verdict['verdict']}", "", verdict["why"], "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, name in enumerate(names):
        f = figures[name]
        if "error" in f:
            lines.append(f"| {name} | " + " | ".join(["failed"] * (len(header) - 1)) + " |")
            continue
        differ = "the recipe's" if i == 0 else (f"differ at {f['tokens_differ_at']}" if f.get("tokens_differ_at")
                                                else "equal")
        accepted = f.get("accepted_length")
        row = ([name] + [_ms(f["step_ms"].get(b)) for b in batches] + [_ms(f["compile_ms"].get(b)) for b in batches]
               + [_ms(f["ttft_ms"][c]) if c in f["ttft_ms"] else "-" for c in contexts]
               + [f"{f['start_to_first_token_ms'] / 1e3:.1f}" if f.get("start_to_first_token_ms") else "-"]
               + [f"{f['tok_s_1']:.1f}" if f.get("tok_s_1") else "-", f"{accepted:.2f}" if accepted else "-", differ])
        lines.append("| " + " | ".join(row) + " |")
    return lines + [""] + node_table(figures)


NODE_COLUMNS = (("graph_pieces", "graph pieces a step launches", "{:.0f}"),
                ("markers_per_step", "markers per replayed step", "{:.0f}"),
                ("dispatch_ms", "host dispatch ms/step", "{:.2f}"), ("execute_ms", "execute_model ms/step", "{:.2f}"),
                ("compilations", "compilations (first run)", "{:.0f}"),
                ("recompilations", "compilations (measured run)", "{:.0f}"),
                ("graph_memory_mib", "graph memory MiB", "{:.0f}"), ("peak_memory_mib", "peak MiB", "{:.0f}"))


def node_table(figures: dict) -> list[str]:
    """The workers' graph probe per setting and batch (graph_probe.py), where a card gave it."""
    rows = [(name, batch, node) for name, f in figures.items() for batch, node in sorted(f.get("node", {}).items())]
    if not rows:
        why = next((f["node_why"] for f in figures.values() if f.get("node_why")), None)
        return [f"Graph pieces, host dispatch and graph memory: not read ({why}).", ""] if why else []
    header = ["setting", "batch"] + [title for _, title, _ in NODE_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, batch, node in rows:
        lines.append("| " + " | ".join([name, str(batch)] + [fmt.format(node[key]) if node.get(key) is not None else "-"
                                                              for key, _, fmt in NODE_COLUMNS]) + " |")
    return lines + [""]


def plot(report: dict, path: Path) -> None:
    """Horizontal bars, one per setting (the recipe's grey, a switch's other settings in one colour)."""
    engine = [v for v in report["verdicts"] if v["premise"] == "engine"]
    bars = []
    for i, v in enumerate(engine):
        for j, (name, f) in enumerate((n, f) for n, f in v["figures"].items() if isinstance(f, dict)):
            colour = "#999999" if j == 0 else ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")[i % 6]
            bars.append((f"{v['switch']} = {name}", (f.get("step_ms") or {}).get(1) or 0.0, colour))
    label_w, bar_w, row_h, top = 330, 420, 22, 40
    top_ms = max((ms for _, ms, _ in bars), default=1.0) or 1.0
    height = top + row_h * len(bars) + 30
    title = f"batch-1 decode step per setting, ms (median): {report['device']}, {report['label']}"
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + bar_w + 80}" height="{height}" '
             'font-family="sans-serif" font-size="11">',
             f'<text x="8" y="18" font-size="12">{escape(title)}</text>']
    for k, (label, ms, colour) in enumerate(bars):
        y = top + k * row_h
        width = bar_w * ms / top_ms
        parts += [f'<text x="{label_w - 6}" y="{y + 14}" text-anchor="end">{escape(label)}</text>',
                  f'<rect x="{label_w}" y="{y + 3}" width="{width:.1f}" height="{row_h - 6}" fill="{colour}"/>',
                  f'<text x="{label_w + width + 4:.1f}" y="{y + 14}">{ms:.2f}</text>']
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def write(report: dict, folder: Path) -> tuple[Path, Path]:
    engine = [v for v in report["verdicts"] if v["premise"] == "engine"]
    premises = [v for v in report["verdicts"] if v["premise"] != "engine"]
    lines = [f"# card-check on {report['device']}: {report['label']}", "",
             f"Host {report['host']}; model {report.get('model', '-')}; workload {report.get('workload', '-')}.", ""]
    extrapolated = report.get("extrapolated_to_52_layers")
    if extrapolated:
        steps = ", ".join(f"batch {b}: {ms:.1f} ms" for b, ms in extrapolated["recipe_decode_step_ms"].items())
        lines += [f"The recipe's decode step extrapolated to 52 layers: {steps}. {extrapolated['label']}", ""]
    lines += ["## Switches, from the engine A/B (the recipe's setting first; grey in the plot)", "",
              f"![batch-1 decode step per setting]({PLOT})", ""]
    for verdict in engine:
        lines += switch_table(verdict)
    lines += ["## Premise rows (diagnostics)", "", "| premise | switch | verdict | why |", "|---|---|---|---|"]
    lines += [f"| `{v['premise']}` | {v['switch']} | {v['verdict']} | {v['why']} |" for v in premises]
    text_path, plot_path = folder / REPORT, folder / PLOT
    text_path.write_text("\n".join(lines) + "\n")
    plot(report, plot_path)
    return text_path, plot_path
