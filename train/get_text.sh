#!/usr/bin/env bash
# Writes the King James Bible, as Debian's `bible-kjv` prints it, to the file named by $1
# (default train/data/kjv.txt). Installs the package (public-domain text) when it is missing.
set -euo pipefail
out=${1:-train/data/kjv.txt}
if ! command -v bible >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bible-kjv >/dev/null
fi
mkdir -p "$(dirname "$out")"
# A wide line so that no verse wraps: one heading line per chapter, one line per verse.
bible -l10000 "gen1:1-rev22:21" >"$out"
wc -c "$out"
