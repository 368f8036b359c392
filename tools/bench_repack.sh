#!/usr/bin/env bash
# Time `qat4 repack` from a synthetic bf16 QAT checkpoint to ct-emb4 and to gguf, with peak RSS
# (/usr/bin/time -v), then check the two outputs hold identical codes with `qat4 verify`.
#   usage: tools/bench_repack.sh [e2b|tiny] [WORKDIR]
# Defaults: e2b, in a new folder under ${TMPDIR:-/tmp}. The e2b source is ~9.3 GB of bf16 and the
# outputs ~5.3 GB; the source is kept in WORKDIR and reused by the next run.
set -euo pipefail
preset=${1:-e2b}
work=${2:-$(mktemp -d "${TMPDIR:-/tmp}/bench_repack.XXXXXX")}
python=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$work"
qat4() { "$python" -m qat4.cli "$@"; }

src="$work/$preset-qat-bf16"
[ -d "$src" ] || qat4 synth --preset "$preset" --format qat-bf16 --out "$src" >/dev/null

# measure LABEL COMMAND...: run under /usr/bin/time -v, keep its report in $work/LABEL.time
measure() {
    local label=$1; shift
    /usr/bin/time -v -o "$work/$label.time" "$@" >"$work/$label.log" 2>&1 || { tail -5 "$work/$label.log"; exit 1; }
}
field() { sed -n "s/^\s*$2: //p" "$work/$1.time"; }
seconds() { awk -F: '{ s = 0; for (i = 1; i <= NF; i++) s = s * 60 + $i; printf "%.1f", s }'; }

declare -A out=([ct-emb4]="$work/$preset-ct-emb4" [gguf]="$work/$preset.gguf")
for to in ct-emb4 gguf; do
    measure "repack-$to" "$python" -m qat4.cli repack "$src" "${out[$to]}" --to "$to" --force
done
measure verify "$python" -m qat4.cli verify "${out[ct-emb4]}" "${out[gguf]}"

src_bytes=$(du -sb "$src" | cut -f1)
printf '\n%-22s %10s %10s %10s %13s %9s\n' "step ($preset)" "source GB" "output GB" "wall s" "peak RSS GB" "RSS/src"
for step in repack-ct-emb4 repack-gguf verify; do
    case $step in
        repack-*) written=$(du -sb "${out[${step#repack-}]}" | cut -f1) ;;
        *) written=0 ;;
    esac
    wall=$(field "$step" "Elapsed (wall clock) time (h:mm:ss or m:ss)" | seconds)
    rss_kb=$(field "$step" "Maximum resident set size (kbytes)")
    awk -v s="$step" -v src="$src_bytes" -v out="$written" -v wall="$wall" -v rss="$rss_kb" 'BEGIN {
        printf "%-22s %10.2f %10.2f %10.1f %13.2f %8.1f%%\n", s, src / 1e9, out / 1e9, wall, rss * 1024 / 1e9, 100 * rss * 1024 / src }'
done
grep -q "identical int4 codes" "$work/verify.log" && echo "verify: identical int4 codes" || { echo "verify: codes differ"; exit 1; }
echo "logs and /usr/bin/time reports: $work"
