#!/usr/bin/env python3
"""The import graph of src/: which module imports which (`crate::` and `super::` paths outside
comments), folded to top-level units (a folder or a root file), with each unit's layer (1 + the
highest layer it imports), the arrows that point up or sideways into a cycle, and the cycles
between files of different folders.

    python3 scripts/imports.py            # summary
    python3 scripts/imports.py --arrows   # every unit-level arrow with the file and line
"""
import os
import re
import sys
from collections import defaultdict

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def modules():
    """Module path (tuple) -> file path, for every .rs file under src/."""
    out = {}
    for dp, _, fs in os.walk(SRC):
        for f in fs:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dp, f), SRC)[:-3].split(os.sep)
            if rel[-1] == "mod":
                rel = rel[:-1]
            if rel in (["lib"],):
                rel = []
            out[tuple(rel)] = os.path.join(dp, f)
    return out


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(re.sub(r"//.*", "", line) for line in text.split("\n"))


def expand_use(tree):
    """`a::{b, c::{d}}` -> ["a::b", "a::c::d"]."""
    tree = tree.strip()
    m = re.match(r"^([\w:]*?)(?:::)?\{(.*)\}$", tree, flags=re.S)
    if not m:
        return [tree.split(" as ")[0].strip()]
    prefix, body = m.group(1), m.group(2)
    parts, depth, cur = [], 0, ""
    for ch in body:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    out = []
    for p in parts:
        if p.strip():
            for sub in expand_use(p):
                out.append(f"{prefix}::{sub}" if prefix else sub)
    return out


def paths_in(text):
    """(line, path) for every crate-rooted or super-rooted path in the code."""
    found = []
    for m in re.finditer(r"\buse\s+((?:crate|super)\s*::[^;]*);", text, flags=re.S):
        line = text.count("\n", 0, m.start()) + 1
        for p in expand_use(re.sub(r"\s+", "", m.group(1))):
            found.append((line, p))
    no_use = re.sub(r"\buse\s+[^;]*;", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    for m in re.finditer(r"\b((?:crate|super)(?:::\w+)+)", no_use):
        found.append((no_use.count("\n", 0, m.start()) + 1, m.group(1)))
    return found


def resolve(mods, here, path):
    segs = path.split("::")
    if segs[0] == "crate":
        base = []
        segs = segs[1:]
    else:
        base = list(here)
        # a file `a/b.rs` is module a::b; `super` in it is a; inline `mod tests` adds a level we
        # ignore (its `super` is the file itself).
        while segs and segs[0] == "super":
            segs = segs[1:]
            base = base[:-1] if base else base
    full = base + [s for s in segs if s not in ("self", "*")]
    for n in range(len(full), 0, -1):
        if tuple(full[:n]) in mods:
            return tuple(full[:n])
    return None


def unit(mod):
    return mod[0] if mod else "lib"


def scc(nodes, edges):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in nodes:
        if v not in index:
            visit(v)
    return out


def main():
    mods = modules()
    file_edges = defaultdict(set)
    where = defaultdict(list)
    for mod, path in mods.items():
        text = strip_comments(open(path).read())
        if path.endswith("main.rs"):  # the binary reaches the library as `horizon::`
            text = re.sub(r"\bhorizon::", "crate::", text)
        for line, p in paths_in(text):
            # `super::` inside a file's inline test module means the file itself.
            target = resolve(mods, mod if p.startswith("crate") else mod, p)
            if target is None or target == mod:
                continue
            if p.startswith("super") and mod and target == mod[:-1] and "tests" in text:
                pass
            file_edges[mod].add(target)
            where[(unit(mod), unit(target))].append(f"{os.path.relpath(path, os.path.dirname(SRC))}:{line}")
    units = sorted({unit(m) for m in mods})
    edges = defaultdict(set)
    for a, bs in file_edges.items():
        for b in bs:
            if unit(a) != unit(b) and unit(a) != "lib":
                edges[unit(a)].add(unit(b))
    comps = scc(units, edges)
    comp_of = {v: i for i, c in enumerate(comps) for v in c}
    layer = {}
    for i, c in enumerate(comps):  # Tarjan emits components in reverse topological order
        deps = {comp_of[w] for v in c for w in edges[v]} - {i}
        layer[i] = 1 + max((layer[d] for d in deps), default=0)
    print(f"units: {len(units)}, layers: {max(layer.values())}, arrows: {sum(len(e) for e in edges.values())}")
    for n in range(max(layer.values()), 0, -1):
        row = sorted(v for i, c in enumerate(comps) if layer[i] == n for v in c)
        print(f"  layer {n:2}: {', '.join(row)}")
    cyc = [c for c in comps if len(c) > 1]
    print(f"cycles between top-level units: {len(cyc)}")
    for c in cyc:
        print("  " + " <-> ".join(sorted(c)))
        for a in c:
            for b in sorted(edges[a]):
                if b in c:
                    print(f"    {a} -> {b}: {', '.join(where[(a, b)][:4])}")
    # cycles between files of different folders
    fnodes = sorted(set(file_edges) | {b for bs in file_edges.values() for b in bs})
    fcomps = scc(fnodes, file_edges)
    cross = [c for c in fcomps if len({unit(m) for m in c}) > 1]
    print(f"file cycles spanning folders: {len(cross)}")
    for c in cross:
        print("  " + " <-> ".join("::".join(m) for m in sorted(c)))
    same = [c for c in fcomps if len(c) > 1 and len({unit(m) for m in c}) == 1]
    print(f"file cycles inside one folder: {len(same)}")
    for c in same:
        print("  " + " <-> ".join("::".join(m) for m in sorted(c)))
    verbs = ["train", "bench", "export", "generate", "plan", "default_job"]
    among = [
        f"run::{a} -> run::{b}"
        for a in verbs
        for b in verbs
        if a != b and ("run", b) in file_edges.get(("run", a), ())
    ]
    print(f"verbs of run/ importing another verb: {len(among)}")
    for line in among:
        print("  " + line)
    if "--arrows" in sys.argv:
        for (a, b), ws in sorted(where.items()):
            if a != b:
                print(f"{a} -> {b}: {', '.join(ws)}")


if __name__ == "__main__":
    main()
