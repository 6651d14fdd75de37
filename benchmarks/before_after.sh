#!/usr/bin/env bash
# Interleaved before/after of a change: `specwire bench` (plain, local, remote pipelined, n-gram)
# and the link's overhead per synchronous round, on two checkouts, one after the other, twice.
#   benchmarks/before_after.sh OLD_TREE NEW_TREE OUT_DIR
# Each tree runs from its own folder (PYTHONPATH), with the Python on PATH; a tree from before
# the benchmarks/ folder existed runs the overhead script as specwire.bench.link_overhead.
set -u
OLD=$1; NEW=$2; OUT=$3
mkdir -p "$OUT"
export OMP_WAIT_POLICY=passive
bench() {  # tree label round
  (cd "$1" && PYTHONPATH="$1" python -m specwire bench --modes plain,local,remote-pipelined,ngram \
     --prompts code --limit 4 -n 48 -t 1 -td 1 --no-plots --no-progress --out "$OUT/bench-$2-$3" \
     > "$OUT/bench-$2-$3.txt" 2>&1)
}
overhead() {  # tree label round
  local module=benchmarks.link_overhead
  [ -d "$1/benchmarks" ] || module=specwire.bench.link_overhead
  (cd "$1" && PYTHONPATH="$1" python -m "$module" -k 2 --rounds 400 > "$OUT/overhead-$2-$3.txt" 2>&1)
}
uptime > "$OUT/load.txt"
for r in 1 2; do
  bench "$OLD" old "$r"; bench "$NEW" new "$r"
  overhead "$OLD" old "$r"; overhead "$NEW" new "$r"
  uptime >> "$OUT/load.txt"
done
