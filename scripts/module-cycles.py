#!/usr/bin/env python3
"""Lists the import circles between the modules of `common`.

A module is a top-level file or folder of common/src (`report`, `comm`, ...), and every folder
is split into its files and subfolders (`parallel::zero`, `experiment::train_run`), so that two
files of one folder that import each other are a circle too. An edge
A -> B is any `crate::B` reference (a `use crate::...` line, including `use crate::{..}`
groups, or a `crate::B::...` path in code) from a file of A; `super::X` references inside a
split folder count too. Prints the edges of every strongly connected component with more
than one module, i.e. every circle. References between a split folder's own mod.rs and its
submodules (parent <-> child, how a Rust folder is built) are left out unless --with-parents.
Exits 1 when there is a circle.

    python3 scripts/module-cycles.py [--with-parents] [common/src]
"""
import os
import re
import sys

def folders_of(root):
    return {n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n))}


SPLIT = set()  # the folders of the root scanned (main() fills it in)


def module_of(rel):
    parts = rel[:-3].split(os.sep)
    if parts[-1] == "mod":
        parts = parts[:-1]
    if not parts or parts[0] == "lib":
        return None
    if parts[0] in SPLIT and len(parts) > 1:
        return parts[0] + "::" + parts[1]
    return parts[0]


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def strip_tests(text):
    # drop `#[cfg(test)] mod tests { ... }` blocks (test-only references are not circles)
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return "".join(out)


def targets(path_text, modules, reexports):
    """Module names referenced by one path `a::b::c` (after `crate::`); a name a split folder
    re-exports (`crate::comm::Layout`) counts as its submodule's (`comm::layout`)."""
    segs = [s for s in re.split(r"::", path_text) if s]
    if not segs:
        return []
    head = segs[0]
    if head in SPLIT and len(segs) > 1:
        if f"{head}::{segs[1]}" in modules:
            return [f"{head}::{segs[1]}"]
        if (head, segs[1]) in reexports:
            return [reexports[(head, segs[1])]]
    return [head] if head in modules else []


def reexports_of(root):
    """(folder, name) -> "folder::sub" for every `pub use sub::{..}` in a split folder's mod.rs."""
    out = {}
    for top in SPLIT:
        p = os.path.join(root, top, "mod.rs")
        if not os.path.exists(p):
            continue
        for m in re.finditer(r"\bpub\s+use\s+(?:self::)?(.*?);", strip_comments(open(p).read()), flags=re.S):
            for path in expand_use(m.group(1)):
                segs = path.split("::")
                if len(segs) >= 2:
                    name = segs[-1].split(" as ")[-1] if " as " in segs[-1] else segs[-1]
                    name = re.sub(r"^.*\bas", "", name)
                    out[(top, name)] = f"{top}::{segs[0]}"
    return out


def expand_use(body):
    """Flattens `a::{b, c::{d}}` into ['a::b', 'a::c::d']."""
    body = re.sub(r"\s+", "", body)
    m = re.match(r"^([^{]*)\{(.*)\}$", body)
    if not m:
        return [body]
    prefix, inner = m.groups()
    items, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    items.append(cur)
    return [p for item in items if item for p in expand_use(prefix + item)]


def scan(root, with_parents):
    files = {}
    for d, _, names in os.walk(root):
        for n in names:
            if n.endswith(".rs"):
                rel = os.path.relpath(os.path.join(d, n), root)
                if os.path.relpath(d, root).split(os.sep)[0] == "bin":
                    continue
                mod = module_of(rel)
                if mod:
                    files.setdefault(mod, []).append(os.path.join(d, n))
    modules = set(files)
    # folder names are modules too when referenced without a submodule (`crate::comm::Layout`)
    modules |= {m.split("::")[0] for m in files}
    reexports = reexports_of(root)
    edges = {}
    for mod, paths in files.items():
        for p in paths:
            text = strip_tests(strip_comments(open(p).read()))
            refs = []
            for m in re.finditer(r"\buse\s+crate::(.*?);", text, flags=re.S):
                refs += expand_use(m.group(1))
            for m in re.finditer(r"(?<!use )\bcrate::((?:\w+::)*\w+)", text):
                refs.append(m.group(1))
            top = mod.split("::")[0]
            if top in SPLIT:
                prefix = top if mod != top else None
                for m in re.finditer(r"\bsuper::(\w+)", text):
                    if prefix:
                        refs.append(f"{prefix}::{m.group(1)}")
                for m in re.finditer(r"\buse\s+super::(.*?);", text, flags=re.S):
                    if prefix:
                        refs += [f"{prefix}::{p}" for p in expand_use(m.group(1))]
            if mod == top and top in SPLIT:
                # the folder's own mod.rs: `sub::item` paths in code (not `pub use`/`pub mod`)
                code = re.sub(r"\bpub\s+(use|mod)\b.*?;", "", text, flags=re.S)
                code = re.sub(r"\bmod\s+\w+\s*;", "", code)
                for m in re.finditer(r"(?<![:\w])(\w+)::", code):
                    if f"{top}::{m.group(1)}" in modules:
                        refs.append(f"{top}::{m.group(1)}")
            for r in refs:
                for t in targets(r, modules, reexports):
                    parent_child = t.split("::")[0] == top and (t == top or mod == top)
                    if t != mod and (with_parents or not parent_child):
                        edges.setdefault(mod, {}).setdefault(t, set()).add(os.path.relpath(p, root))
    return modules, edges


def sccs(nodes, edges):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return [c for c in out if len(c) > 1]


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    with_parents = "--with-parents" in sys.argv
    root = args[0] if args else os.path.join(os.path.dirname(__file__), "..", "common", "src")
    SPLIT.update(folders_of(root))
    modules, edges = scan(root, with_parents)
    comps = sccs(modules, edges)
    if not comps:
        print("no import circles")
        return 0
    for comp in sorted(comps):
        print("circle: " + " <-> ".join(comp))
        for a in comp:
            for b in sorted(edges.get(a, {})):
                if b in comp:
                    print(f"    {a} -> {b}   ({', '.join(sorted(edges[a][b]))})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
