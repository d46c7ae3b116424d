"""The GPU figures the docs quote, written from the committed table (results/gpu-check.json) into
blocks that begin with `<!-- gpu-check:NAME -->` and end with `<!-- /gpu-check:NAME -->`:

    bench/gpu_check.py --docs           rewrite the blocks in the pages below
    bench/gpu_check.py --docs --check   exit 1 naming each block that is not what the table gives

A figure a page quotes outside such a block is a copy that can go stale; a test holds the blocks
to the table, and the pages to saying "not run on a GPU" only inside them.
"""
import os
import re

from . import output, table, tiers

PAGES = ["README.md", "docs/speed.md", "docs/gpu-bundle.md", "docs/course.md", "results/README.md"]
BLOCK = re.compile(r"(<!-- gpu-check:([\w-]+) -->\n)(.*?)(<!-- /gpu-check:\2 -->)", re.S)
# Phrases about GPU runs that belong only in generated blocks (they go stale by themselves).
STALE = re.compile(r"(?i)\b(not|never)( yet)? (been )?run on an? (GPU|H100|H200)|not run on a GPU yet|never ran on a GPU")


def run_of(row):
    return table.provenance_label(row) or "not run"


def cell(text):
    return (text or "").replace("|", "/")


def rows_table(rows, empty):
    if not rows:
        return empty + "\n"
    lines = ["| check | verdict | figure | ratio | run |", "|---|---|---|---:|---|"]
    for r in rows:
        ratio = "" if r.get("ratio") is None else f"{r['ratio']:.2f}x"
        figure = r.get("figure") or r.get("detail") or ""
        lines.append(f"| {cell(r['path'])} | {r['verdict']} | {cell(figure)} | {ratio} | {run_of(r)} |")
    return "\n".join(lines) + "\n"


def against(row):
    """What a timing row's ratio is against: the fastest of the peers over its rounds (the timing
    tiers), or, for a row from before them, one pair against PyTorch eager's default optimizer."""
    extra = row.get("extra") or {}
    if extra.get("fastest_peer"):
        return f"the fastest of {extra.get('peers', '?').replace(' ', ', ')}; {extra.get('rounds', '?')} rounds"
    if "Lightning" in row["path"] or "lightning" in row["path"]:
        return "the Lightning Trainer"
    if "JPEG" in row["path"]:
        return "PyTorch + torchvision's DataLoader"
    return "PyTorch eager, its default Adam; one pair"


def timings_table(rows):
    if not rows:
        return "No timing has run on a GPU yet.\n"
    lines = ["| check | verdict | figure | ratio | against | run |", "|---|---|---|---:|---|---|"]
    for r in rows:
        ratio = "" if r.get("ratio") is None else f"{r['ratio']:.2f}x"
        lines.append(f"| {cell(r['path'])} | {r['verdict']} | {cell(r.get('figure') or r.get('detail') or '')} | {ratio} | {cell(against(r))} | {run_of(r)} |")
    return "\n".join(lines) + "\n"


def summary(recorded, plan):
    runs = table.runs_of(recorded["checks"])
    ran = {r.get("check", r["path"]) for r in recorded["checks"] if table.ran(r["verdict"]) and not r["verdict"].startswith("not run")}
    by_tier = {t: [p.path for p in plan if p.tier == t] for t in sorted(tiers.NAMES)}
    done = [t for t, names in by_tier.items() if names and all(n in ran for n in names)]
    lines = [f"The committed table (`results/gpu-check.md`, {len(recorded['checks'])} rows) holds rows from {', '.join(runs) or 'no run'}.",
             f"Tiers whose every check has a row there: {', '.join(map(str, done)) or 'none'}; "
             f"`run.sh --next` runs tier {next((t for t in by_tier if t not in done), '(none left)')} next."]
    never = [p.path for p in plan if p.path not in ran]
    if never:
        lines.append(f"Not run on a GPU yet: {len(never)} of the {len(plan)} checks the tiers plan, among them "
                     + "; ".join(f"\"{n}\"" for n in never[:4]) + ".")
    return "\n".join(lines) + "\n"


def generate(recorded, plan):
    """{block name: its text} from `recorded` (the committed table) and `plan` (the checks the
    tiers plan for a GPU: their tier, kind and name)."""
    kind = {p.path: p.kind for p in plan}
    of_kind = lambda k: [r for r in recorded["checks"] if kind.get(r.get("check", r["path"])) == k]
    timing = [r for r in recorded["checks"] if r["path"].startswith("timing")]
    graphs = [r for r in recorded["checks"] if "--cuda-graph" in r["path"]]
    mfu = [r for r in recorded["checks"] if "MFU" in r["path"]]
    memory = [r for r in recorded["checks"] if r["path"].startswith("peak memory")]
    return {
        "summary": summary(recorded, plan),
        "timings": timings_table(timing),
        "learning": rows_table(of_kind("learning"), "No exercise has run on a GPU yet."),
        "multirank": rows_table(of_kind("multirank"), "None of the multi-rank rows (2 and 4 ranks against 1, over NCCL) has run on a GPU yet: "
                                                      "`run.sh --tier 1` runs them first."),
        "graphs": rows_table(graphs, "`--cuda-graph` has not run on a GPU yet."),
        "mfu": rows_table(mfu, "The 1.4B model's MFU has not been measured on a GPU yet."),
        "memory": rows_table(memory, "No peak memory has been measured on a GPU yet."),
        "course": rows_table(of_kind("course"), "The course tier has not run on a GPU yet (`run.sh --tier course`; its printouts and charts then go to "
                                                "`results/course-gpu/`)."),
        "tiers": "| tier | what | checks |\n|---:|---|---:|\n" + "\n".join(
            f"| {t} | {tiers.NAMES[t]} | {sum(1 for p in plan if p.tier == t)} |" for t in sorted(tiers.NAMES)) + "\n",
    }


def rewrite(text, blocks):
    """`text` with each block's content replaced; (new text, names of blocks it has, unknown names)."""
    seen, unknown = [], []

    def replace(m):
        name = m.group(2)
        if name not in blocks:
            unknown.append(name)
            return m.group(0)
        seen.append(name)
        return m.group(1) + blocks[name] + m.group(4)
    return BLOCK.sub(replace, text), seen, unknown


def outside_blocks(text):
    return BLOCK.sub("", text)


def update(root, recorded, plan, check):
    """Rewrites (or, with `check`, compares) every page's blocks; the problems found, one line each."""
    blocks = generate(recorded, plan)
    problems = []
    for page in PAGES:
        path = os.path.join(root, page)
        with open(path) as f:
            text = f.read()
        new, seen, unknown = rewrite(text, blocks)
        problems += [f"{page}: unknown block gpu-check:{name}" for name in unknown]
        for line in outside_blocks(text).splitlines():
            if STALE.search(line):
                problems.append(f"{page}: says what has or has not run on a GPU outside a generated block: {line.strip()[:120]}")
        if new != text:
            if check:
                problems.append(f"{page}: its gpu-check blocks ({', '.join(seen)}) are not what results/gpu-check.json gives: bench/gpu_check.py --docs rewrites them")
            else:
                output.write(path, new)
    return problems
