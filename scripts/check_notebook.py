"""Checks a notebook that nbconvert has executed (scripts/notebooks runs it afterwards).

nbconvert stops at a cell error, but evcxr reports only compile errors as errors: a panic, or an
error returned by `?`, is printed on the cell's stderr and the notebook goes on. So besides every
code cell having run, this fails on anything a cell wrote to stderr other than our own warnings
(lines starting with "WARNING:" or "warning:"), and on a notebook that displayed no chart (evcxr's
image/svg+xml output)."""
import json
import re
import sys

ALLOWED_STDERR = ("WARNING:", "warning:")

path = sys.argv[1]
cells = [c for c in json.load(open(path))["cells"] if c["cell_type"] == "code"]
problems = []
for i, cell in enumerate(cells, 1):
    if cell.get("execution_count") is None and "".join(cell["source"]).strip():
        problems.append(f"code cell {i} did not run")
    stderr = "".join("".join(o["text"]) for o in cell.get("outputs", []) if o.get("name") == "stderr")
    unexpected = [line for line in stderr.splitlines() if line.strip() and not line.startswith(ALLOWED_STDERR)]
    if unexpected:
        problems.append(f"code cell {i} failed (a panic or an error from `?`):\n    " + "\n    ".join(unexpected[:12]))
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            traceback = re.sub(r"\x1b\[[0-9;]*m", "", "\n    ".join(out.get("traceback") or [str(out.get("evalue"))]))
            problems.append(f"code cell {i} failed: {out.get('ename')}:\n    {traceback}")
charts = sum("image/svg+xml" in out.get("data", {}) for c in cells for out in c.get("outputs", []))
if charts == 0:
    problems.append("no chart was displayed (no image/svg+xml output)")
for p in problems:
    print(f"{path}: {p}", file=sys.stderr)
sys.exit(1 if problems else 0)
