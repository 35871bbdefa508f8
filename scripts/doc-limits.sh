#!/usr/bin/env bash
# Keeps the two top-level documents maps, not diaries: README.md at most 300 lines,
# ARCHITECTURE.md at most 500. Guides go under docs/, measurements into the logs under bench/
# (bench/RESULTS.md for current figures). Run from the repository root; exits 1 naming each
# document over its limit.
set -euo pipefail

status=0
check() { # file, limit
    local file=$1 limit=$2 lines
    if [[ ! -f "$file" ]]; then
        echo "doc-limits: $file not found (run from the repository root)" >&2
        status=1
        return
    fi
    lines=$(wc -l < "$file")
    if (( lines > limit )); then
        echo "doc-limits: $file has $lines lines, over its limit of $limit." >&2
        echo "  Move guides to docs/ and measurements to the logs under bench/ (see bench/RESULTS.md)." >&2
        status=1
    else
        echo "doc-limits: $file: $lines of at most $limit lines"
    fi
}

check README.md 300
check ARCHITECTURE.md 500
exit "$status"
