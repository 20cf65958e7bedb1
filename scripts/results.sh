#!/usr/bin/env bash
# Regenerates docs/RESULTS.md (issue 35): trains, with the current defaults and 3 seeds, every
# setup of the page whose scoreboard is not stored under docs/results/page/ yet (as root: the
# links are shaped with tc in network namespaces this run makes and removes), then rebuilds the
# page and its figures from every stored scoreboard. Delete a JSON to train its setups again.
# Each workload's two links take 40-60 minutes of a 2-core machine; the 4-worker one longer.
set -euo pipefail
cd "$(dirname "$0")/.."
GRAVAC=${GRAVAC:-.venv/bin/gravac}
PAGE=docs/results/page

train() {  # NAME, then the scoreboard's options
    local out=$PAGE/$1.json
    shift
    if [[ ! -e $out ]]; then
        "$GRAVAC" compare --scoreboard --baselines "$@" --out "$out"
    fi
}

mkdir -p "$PAGE"
for w in vgg-digits resnet-digits lstm-text; do
    train "$w" --setups "$w@1gbit,$w@100mbit"
done
train vgg-digits-4w --workers 4 --setups vgg-digits@1gbit,vgg-digits@100mbit
"$GRAVAC" compare --scoreboard --from-json "$PAGE"/*.json --report docs/RESULTS.md
