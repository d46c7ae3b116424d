"""The check's record: rows, their verdicts and provenance, the Markdown table, and tables read,
merged and written.

Every row carries where it was measured: the GPU's name, the commit of the binaries, when it
finished and its wall time. A table merged from several runs, or resumed from an earlier one,
keeps each row's own provenance; the header lists the runs its rows came from. A row is never
relabelled as another run's.
"""
import json
import os
import sys
import time

from . import output

# Verdicts. Only "fail" fails the command; "not run (...)" rows are what --resume-from runs.
PASS, FAIL, BELOW, SKIPPED = "pass", "fail", "below goal", "skipped"
NOT_RUN_BUDGET, NOT_REACHED, INTERRUPTED = "not run (budget)", "not run (not reached)", "not run (interrupted)"
DONE = (PASS, BELOW)
LEFT = (NOT_RUN_BUDGET, NOT_REACHED, INTERRUPTED)


def ran(verdict):
    """Whether a row's check ran to a verdict (or could not run here for good: "not run (needs ...)")."""
    return verdict not in LEFT


def short_gpu(name):
    """'NVIDIA H200' -> 'H200'; the CPU stays 'cpu'."""
    name = (name or "cpu").strip()
    return name[len("NVIDIA "):] if name.startswith("NVIDIA ") else name


def when(seconds):
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(seconds or 0))


def provenance_label(row):
    """The run a row came from, as the table's last column shows it."""
    if row.get("finished_at") is None:
        return ""
    return f"{short_gpu(row.get('gpu'))} {row.get('commit', '?')} {when(row['finished_at'])[:10]}"


def render(rows, header):
    """The Markdown table of `rows`, with a closing count line."""
    lines = [header, "", "| tier | path | verdict | figure | ratio to the fastest peer | s | run |", "|---:|---|---|---|---:|---:|---|"]
    for c in rows:
        ratio = "" if c.get("ratio") is None else f"{c['ratio']:.2f}x"
        figure = c.get("figure", "")
        if c.get("detail") and c["verdict"] != PASS:
            figure = f"{figure}; {c['detail']}" if figure else c["detail"]
        seconds = "" if c.get("seconds") is None else f"{c['seconds']:.0f}"
        tier = "" if c.get("tier") is None else str(c["tier"])
        lines.append(f"| {tier} | {c['path']} | {c['verdict']} | {figure.replace('|', '/')} | {ratio} | {seconds} | {provenance_label(c)} |")
    counts = {}
    for c in rows:
        counts[c["verdict"]] = counts.get(c["verdict"], 0) + 1
    lines += ["", ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) or "no checks"]
    return "\n".join(lines) + "\n"


def runs_of(rows):
    """The distinct runs (GPU, commit, day) the rows came from, in the order they first appear."""
    seen = []
    for r in rows:
        label = provenance_label(r)
        if label and label not in seen:
            seen.append(label)
    return seen


def header_of(recorded):
    where = recorded.get("gpu") or "the CPU"
    budget = f" (budget {recorded['budget']:.0f} s)" if recorded.get("budget") else ""
    tier = f", tier {recorded['tier']}" if recorded.get("tier") else ""
    header = (f"gpu-check on {where} ({recorded.get('gpus', 0)} GPU(s)){tier}, {when(recorded.get('finished_at'))}, commit {recorded.get('commit', '?')}, "
              f"{recorded.get('seconds', '?')} s{budget}")
    resumed = recorded.get("resumed_from")
    if resumed:
        header += f", resuming the run of commit {resumed.get('commit', '?')}"
    runs = runs_of(recorded.get("checks", []))
    if len(runs) > 1 or recorded.get("merged_from"):
        header += "\n\nRows from " + "; ".join(runs) + " (each row's own run is in its last column)."
    if recorded.get("note"):
        header += f"\n\n{recorded['note']}"
    return header


def verdict_exit(rows):
    return 1 if any(c["verdict"] == FAIL for c in rows) else 0


def write(json_path, recorded):
    """The table a person reads first, then the record --resume-from reads: a run killed between
    the two leaves a record no further along than its table. Each is written whole or not at all
    (output.write); something at either name that cannot be replaced is refused before either is
    written."""
    md_path = json_path[:-len(".json")] + ".md"
    output.check_file(md_path)
    output.check_file(json_path)
    output.write(md_path, render(recorded["checks"], header_of(recorded)))
    output.write(json_path, json.dumps(recorded, indent=2) + "\n")


def read(path, what):
    """A recorded check (its .json, or the .md beside it), or one line and exit 2."""
    if path.endswith(".md") and os.path.exists(path[:-3] + ".json"):
        path = path[:-3] + ".json"
    try:
        with open(path) as f:
            recorded = json.load(f)
        if not isinstance(recorded.get("checks"), list):
            raise ValueError("no list of checks")
        return with_provenance(recorded)
    except (OSError, ValueError, AttributeError) as e:
        print(f"gpu-check: cannot read the recorded check {path} ({what}): {e}", file=sys.stderr)
        sys.exit(2)


def with_provenance(recorded):
    """A table written before rows carried their own provenance: its rows get the table's (the
    GPU, commit and time it names), so that a later merge does not take them for its own."""
    for row in recorded["checks"]:
        if "finished_at" not in row and ran(row.get("verdict", "")) and row.get("seconds") is not None:
            row.update(gpu=recorded.get("gpu"), commit=recorded.get("commit"), finished_at=recorded.get("finished_at"))
    return recorded


def merge(tables, order=None):
    """One table of `tables` (earliest first): a check's rows from the latest table that ran it
    replace the earlier ones; rows keep their own provenance. `order`: check names in the order
    the merged rows should follow (the plan's); checks it does not name follow in the order they
    first appear."""
    latest = {}
    appearance = []
    for t in tables:
        by_check = {}
        for row in t["checks"]:
            by_check.setdefault(row.get("check", row["path"]), []).append(row)
        for check, rows in by_check.items():
            if check not in appearance:
                appearance.append(check)
            if any(ran(r["verdict"]) for r in rows) or check not in latest:
                latest[check] = rows
    ranked = {c: i for i, c in enumerate(order or [])}
    checks = sorted(appearance, key=lambda c: (ranked.get(c, len(ranked)), appearance.index(c)))
    rows = [r for c in checks for r in latest[c]]
    last = tables[-1]
    return {
        "finished_at": max(t.get("finished_at") or 0 for t in tables), "seconds": sum(r.get("seconds") or 0 for r in rows),
        "device": last.get("device"), "gpu": last.get("gpu"), "gpus": last.get("gpus"), "commit": last.get("commit"),
        "merged_from": [{"commit": t.get("commit"), "gpu": t.get("gpu"), "finished_at": t.get("finished_at"), "tier": t.get("tier")} for t in tables],
        "complete": all(ran(r["verdict"]) for r in rows), "checks": rows,
    }
