#!/usr/bin/env bash
# Ours (S2) against vLLM's CPU build, side by side in one sitting, one table at the end.
#
#   bench/side_by_side.sh            the quiet-window run (issue 46): 1000 prompt + 64 output
#                                    tokens, 1, 16 and 64 concurrent requests, bounded ~25 min
#   bench/side_by_side.sh --smoke    the same path at toy sizes (1 and 2 requests, 16 prompt
#                                    + 4 output tokens): checks that everything runs
#
# For each allocator (glibc, then tcmalloc when /usr/lib/x86_64-linux-gnu/
# libtcmalloc_minimal.so.4 exists; skipped with a line otherwise) and each client (ours,
# then vLLM's `vllm bench serve`), one `python -m bench.serve_bench --orgs S2` call: our
# server then vLLM's (arms alternate call after call), each measured at every concurrency
# (one server start per arm; streaming, EOS ignored, greedy). Then BENCH=kernel's paged vs
# contiguous decode (limit 1.10x), and `python -m bench.side_by_side` prints the table:
# output tok/s, ratio ours / vLLM against the target, TTFT p99, server CPU ms and faults per
# output token. Each step is under `timeout`; results in bench/results/side_by_side/.
# Last, while the 1,500 s budget leaves 200 s: ours at --threads 1 (glibc, our client), read
# against the glibc vLLM rows (row alloc "glibc-t1").
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=bench/results/side_by_side
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
if [ "${1:-}" = "--smoke" ]; then
    CONC=1,2 PROMPT=16 OUTPUT=4 STEP_S=600 KERNEL=(--repeats 1)
    OUT=$OUT/smoke
elif [ -z "${1:-}" ]; then
    CONC=1,16,64 PROMPT=1000 OUTPUT=64 STEP_S=330 KERNEL=(--repeats 9)
else
    echo "error: argument=$1: allowed values are --smoke or none" >&2
    exit 2
fi
rm -rf "$OUT" && mkdir -p "$OUT"
ALLOCATORS=glibc
if [ -e "$TCMALLOC" ]; then
    ALLOCATORS="glibc tcmalloc"
else
    echo "tcmalloc half skipped: $TCMALLOC is absent (apt-get install libtcmalloc-minimal4)"
fi
start=$(date +%s)
for alloc in $ALLOCATORS; do
    for client in ours vllm; do
        echo "== $alloc, $client client ($(($(date +%s) - start)) s)"
        timeout "$STEP_S" "$PY" -m bench.serve_bench --orgs S2 --concurrency "$CONC" \
            --prompt "$PROMPT" --output "$OUTPUT" --client "$client" --allocator "$alloc" \
            --out "$OUT/${alloc}_${client}.json" > "$OUT/${alloc}_${client}.log" 2>&1 \
            || echo "   failed or timed out after $STEP_S s (exit $?): see $OUT/${alloc}_${client}.log"
    done
done
echo "== kernel: paged vs contiguous decode ($(($(date +%s) - start)) s)"
timeout 150 "$PY" -m bench.kernel_bench --skip-generate --skip-tq4 "${KERNEL[@]}" \
    > "$OUT/kernel.log" 2>&1 && cp bench/results/kernels.json "$OUT/kernels.json" \
    || echo "   kernel bench failed or timed out: see $OUT/kernel.log"
# ours at one intra-op thread (against auto above), if the budget (1,500 s) leaves room
left=$((1500 - ($(date +%s) - start)))
if [ "$left" -gt 200 ]; then
    echo "== glibc, ours client, ours at --threads 1 ($(($(date +%s) - start)) s)"
    timeout "$((left < STEP_S ? left : STEP_S))" "$PY" -m bench.serve_bench --orgs S2 \
        --concurrency "$CONC" --prompt "$PROMPT" --output "$OUTPUT" --client ours \
        --allocator glibc --threads 1 --vllm-python /nonexistent \
        --out "$OUT/glibc-t1_ours.json" > "$OUT/glibc-t1_ours.log" 2>&1 \
        || echo "   failed or timed out (exit $?): see $OUT/glibc-t1_ours.log"
else
    echo "== ours at --threads 1 skipped: $left s left of the 1,500 s budget"
fi
echo "== done in $(($(date +%s) - start)) s, load average $(cut -d' ' -f1-3 /proc/loadavg)"
"$PY" -m bench.side_by_side "$OUT"
