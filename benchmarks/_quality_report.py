"""Report of benchmarks/quality.py: the issue's targets per task, the markdown results table
and the two figures (accuracy vs density; density, total rank and loss over steps)."""

from __future__ import annotations

import statistics
from pathlib import Path

ONE_LABEL_SHARE = 0.99  # a model answering one label on this share of the test rows or more learned only a prior


def targets(rows: dict) -> dict:
    lora, apt, ptt = rows.get("lora"), rows.get("apt_0.7"), rows.get("ptt_0.7")
    if not (lora and apt):
        return {}
    out = {
        "apt0.7_acc_ge_90pct_lora": apt["accuracy"] >= 0.9 * lora["accuracy"],
        "apt0.7_time_le_lora": apt["train_time_s"] <= lora["train_time_s"],
        "apt0.7_cpu_time_le_lora": apt.get("train_cpu_s", 1e18) <= lora.get("train_cpu_s", 0),
        "apt0.7_post_event_peak_lt_lora": (apt.get("peak_rss_after_last_event_mb") or 1e18) < (lora.get("peak_rss_after_last_event_mb") or 0),
        "apt0.7_peak_le_1.1x_lora": apt["peak_rss_mb"] <= 1.1 * lora["peak_rss_mb"],
    }
    if ptt:
        out["apt0.7_acc_gt_ptt0.7"] = apt["accuracy"] > ptt["accuracy"]
    if lora.get("auc") is not None:  # without it the accuracy targets compare label priors, not learning
        out["task_learned_by_lora_auc_gt_0.55"] = lora["auc"] > 0.55
    shares = (apt.get("predicted_share") or {}).values()
    if shares:  # a model that gives one answer to (nearly) every row passes the accuracy targets by the label prior
        out["apt0.7_answers_both_labels"] = max(shares) < ONE_LABEL_SHARE
    return out


def _fmt(value, spec=".3f", missing="–"):
    return missing if value is None else format(value, spec)


def _first_share(row: dict, key: str):
    shares = row.get(key)
    return next(iter(shares.values())) if shares else None


def markdown(summary: dict, method_order: list[str]) -> str:
    lines = []
    for task, rows in summary["tasks"].items():
        styles = sorted({r.get("prompt_style", "alpaca") for r in rows.values()})
        lines += [f"\n#### {task} ({len(rows)} runs; {'/'.join(styles)} prompts)\n",
                  "| method | density | params (M) | accuracy | acc / LoRA | AUC | best-threshold acc | predicted share of first label | train s | time / LoRA | CPU / LoRA | peak RSS MB | peak / LoRA "
                  "| RSS at last event / LoRA | recovery peak / LoRA | export MB | size / dense | decode tok/s | decode / dense "
                  "| FLOPs/tok / dense |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for method in method_order:
            if method not in rows:
                continue
            r = rows[method]
            sp = r.get("speed", {})
            lines.append(
                f"| {method} | {_fmt(r.get('density'))} | {_fmt(r.get('total_params', 0) / 1e6, '.1f')} | {_fmt(r.get('accuracy'))} "
                f"| {_fmt(r.get('acc_vs_lora'))} | {_fmt(r.get('auc'))} | {_fmt(r.get('best_threshold_accuracy'))} | {_fmt(_first_share(r, 'predicted_share'))} "
                f"| {_fmt(r.get('train_time_s'), '.0f')} | {_fmt(r.get('train_time_s_vs_lora'), '.2f')} "
                f"| {_fmt(r.get('train_cpu_s_vs_lora'), '.2f')} "
                f"| {_fmt(r.get('peak_rss_mb'), '.0f')} | {_fmt(r.get('peak_rss_mb_vs_lora'), '.3f')} "
                f"| {_fmt(r.get('rss_after_last_event_mb_vs_lora'), '.3f')} "
                f"| {_fmt(r.get('peak_rss_after_last_event_mb_vs_lora'), '.3f')} "
                f"| {_fmt((r.get('export_bytes') or 0) / 2**20 if r.get('export_bytes') else None, '.0f')} "
                f"| {_fmt(r.get('export_bytes_vs_lora'), '.3f')} | {_fmt(sp.get('decode_tokens_per_s'), '.1f')} "
                f"| {_fmt(r.get('decode_speed_vs_dense'), '.2f')} | {_fmt(r.get('flops_per_token_vs_lora'), '.3f')} |"
            )
        share = next((_first_share(r, "gold_share") for r in rows.values() if r.get("gold_share")), None)
        if share is not None:
            first = next(iter(next(r for r in rows.values() if r.get("gold_share"))["gold_share"]))
            lines.append(f"\nTest rows labelled '{first}': {share:.3f}; a one-label model scores {max(share, 1 - share):.3f}.")
        t = summary.get("targets", {}).get(task)
        if t:
            lines.append("\nTargets: " + ", ".join(f"{k}: {'PASS' if v else 'MISS'}" for k, v in t.items()))
    return "\n".join(lines) + "\n"


def phase_split(out: Path, summary: dict) -> str:
    """Per task, summed step_time_s of APT 0.7 and LoRA in the phases of APT 0.7's schedule
    (pruning events' own time is not in step_time_s): where APT pays and where it saves."""
    from apt_ds.algorithm.schedule import SALIENCE_WARMUP_STEPS
    from apt_ds.io.metrics import read_metrics

    lines = []
    for task, rows in summary["tasks"].items():
        paths = {m: out / task / m / "metrics.jsonl" for m in ("apt_0.7", "lora")}
        if "apt_0.7" not in rows or not all(p.is_file() for p in paths.values()):
            continue
        start, end = rows["apt_0.7"]["apt_config"]["pruning_start_step"], rows["apt_0.7"]["apt_config"]["pruning_end_step"]
        warm = max(0, start - SALIENCE_WARMUP_STEPS)
        # metrics' "step" counts steps done: step index i is logged as i + 1
        seconds = {m: [r for r in read_metrics(p) if "step_time_s" in r] for m, p in paths.items()}
        final = max(r["step"] for r in seconds["apt_0.7"])
        phases = (("before salience", 1, warm), ("salience warm-up", warm + 1, start),
                  ("pruning: teacher passes, salience, events", start + 1, end), ("recovery: final shape, no teacher", end + 1, final))
        lines += [f"\n#### {task}: step time per phase of APT 0.7's schedule (summed step_time_s)\n",
                  "| phase (steps) | APT 0.7 s | LoRA s | APT / LoRA |", "|---|---|---|---|"]
        totals = {m: 0.0 for m in paths}
        for name, first, last in phases:
            if last < first:
                continue
            sums = {m: sum(r["step_time_s"] for r in recs if first <= r["step"] <= last) for m, recs in seconds.items()}
            for m in totals:
                totals[m] += sums[m]
            lines.append(f"| {name} ({first}–{last}) | {sums['apt_0.7']:.1f} | {sums['lora']:.1f} "
                         f"| {_fmt(sums['apt_0.7'] / sums['lora'] if sums['lora'] else None, '.2f')} |")
        lines.append(f"| total | {totals['apt_0.7']:.1f} | {totals['lora']:.1f} "
                     f"| {_fmt(totals['apt_0.7'] / totals['lora'] if totals['lora'] else None, '.2f')} |")
    return "\n".join(lines) + "\n"


def plots(summary: dict, out: Path, img_dir: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[quality] matplotlib missing: no plots (pip install matplotlib)", flush=True)
        return
    from apt_ds.io.metrics import read_metrics

    img_dir.mkdir(parents=True, exist_ok=True)
    tasks = list(summary["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rows = summary["tasks"][task]
        for kind, label, style in (("apt", "APT non-uniform", "o-"), ("apt_uniform", "APT uniform", "s--"), ("ptt", "prune-then-tune", "^:")):
            pts = sorted((r["density"], r["accuracy"]) for m, r in rows.items()
                         if m.startswith(kind.split("_")[0] + "_") and (m.endswith("_uniform") == kind.endswith("uniform"))
                         and not m.endswith("_nodistill"))
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        for method, row in rows.items():
            if method.endswith("_nodistill"):
                ax.plot([row["density"]], [row["accuracy"]], "rx", markersize=8,
                        label="APT w/o distillation" if method == "apt_0.7_nodistill" or "apt_0.7_nodistill" not in rows else None)
        if "lora" in rows:
            ax.plot([rows["lora"]["density"]], [rows["lora"]["accuracy"]], "k*", markersize=11, label="LoRA (dense)")
        if "zero_shot" in rows:
            ax.axhline(rows["zero_shot"]["accuracy"], color="gray", lw=0.8, ls="--", label="zero-shot")
        share = next((_first_share(r, "gold_share") for r in rows.values() if r.get("gold_share")), None)
        if share is not None:
            ax.axhline(max(share, 1 - share), color="tab:red", lw=0.8, ls=":", label="majority label")
        ax.set_title(task)
        ax.set_xlabel("density (block params kept)")
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(img_dir / "quality_accuracy.png", dpi=90)
    plt.close(fig)

    fig, axes = plt.subplots(len(tasks), 3, figsize=(12, 3.0 * len(tasks)), squeeze=False)
    for row_axes, task in zip(axes, tasks):
        for method in ("lora", "apt_0.7", "apt_0.5", "apt_0.7_uniform", "apt_0.5_uniform", "ptt_0.7"):
            path = out / task / method / "metrics.jsonl"
            if not path.is_file():
                continue
            recs = [r for r in read_metrics(path) if "loss" in r]
            steps = [r["step"] for r in recs]
            style = "--" if method.endswith("uniform") else "-"
            # prune-then-tune logs density vs its (already pruned) start: rescale to the original
            scale = summary["tasks"][task].get(method, {}).get("density", 1.0) if method.startswith("ptt") else 1.0
            row_axes[0].plot(steps, [r["density"] * scale for r in recs], style, label=method)
            row_axes[1].plot(steps, [r["total_rank"] for r in recs], style, label=method)
            loss = [r["task_loss"] for r in recs]
            smooth = [statistics.mean(loss[max(0, i - 4) : i + 1]) for i in range(len(loss))]
            row_axes[2].plot(steps, smooth, style, label=method)
        for ax, title in zip(row_axes, ("block density", "total adapter rank", "task loss (5-step mean; APT's total\nloss adds distillation)")):
            ax.set_title(f"{task}: {title}", fontsize=9)
            ax.set_xlabel("optimizer step")
            ax.grid(alpha=0.3)
        row_axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(img_dir / "quality_curves.png", dpi=80)
    plt.close(fig)
    print(f"[quality] plots: {img_dir / 'quality_accuracy.png'}, {img_dir / 'quality_curves.png'}", flush=True)
