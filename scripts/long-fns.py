#!/usr/bin/env python3
"""Functions of at least N lines (default 100) under the given folders (default src/engine):
a `fn` line to the `}` at its indentation (rustfmt layout), test modules included.

    python3 scripts/long-fns.py [N] [folder ...]
"""
import os
import re
import sys

args = sys.argv[1:]
limit = int(args.pop(0)) if args and args[0].isdigit() else 100
roots = args or ["src/engine"]
found = []
for root in roots:
    for dp, _, fs in os.walk(root):
        for f in sorted(fs):
            if not f.endswith(".rs"):
                continue
            p = os.path.join(dp, f)
            lines = open(p).read().split("\n")
            for i, l in enumerate(lines):
                m = re.match(r"^(\s*)(pub(\([\w:]+\))?\s+)?(const\s+)?(unsafe\s+)?fn\s+(\w+)", l)
                if not m:
                    continue
                k = i
                while k < len(lines) and not lines[k].rstrip().endswith(("{", ";")):
                    k += 1
                if k >= len(lines) or lines[k].rstrip().endswith(";"):
                    continue
                j = i + 1
                while j < len(lines) and lines[j] != m.group(1) + "}":
                    j += 1
                if j - i + 1 >= limit:
                    found.append((j - i + 1, f"{p}:{i + 1}", m.group(6)))
for n, where, name in sorted(found, reverse=True):
    print(f"{n:5} {where} {name}")
print(f"{len(found)} function(s) of {limit} lines or more in {', '.join(roots)}")
