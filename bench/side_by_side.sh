#!/usr/bin/env bash
# Ours (S2) against vLLM's CPU build, side by side in one sitting, one table at the end.
#
#   bench/side_by_side.sh            the quiet-window run (issue 46): 1000 prompt + 64 output
#                                    tokens, 1, 16 and 64 concurrent requests, bounded ~12 min
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
#
# First, ours alone in each engine-core mode of MODES (space-separated
# CORE:THREADS[:OMP[:SPLIT]], default "thread:1 process:1 process:2:passive":
# serving_core.server --engine-core CORE --threads THREADS --omp-wait OMP --split-workers
# SPLIT, SPLIT auto unless given) at the top concurrency, glibc, our client (rows
# "glibc-<core><threads>[p]", read against the glibc vLLM rows); the mode with the most
# output tok/s then serves ours in the full table. MODES= (empty) skips it (ours: thread
# core, --threads auto). Bounded ~12 min on 2 cores.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=bench/results/side_by_side
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
if [ "${1:-}" = "--smoke" ]; then
    CONC=1,2 TOP=2 PROMPT=16 OUTPUT=4 STEP_S=600 MODE_S=300 KERNEL=(--repeats 1)
    OUT=$OUT/smoke
elif [ -z "${1:-}" ]; then
    CONC=1,16,64 TOP=64 PROMPT=1000 OUTPUT=64 STEP_S=330 MODE_S=120 KERNEL=(--repeats 9)
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
MODES=${MODES-thread:1 process:1 process:2:passive}
OURS=()  # our server's options in the full table: the best mode's
best=0
for mode in $MODES; do
    IFS=: read -r core threads omp split <<< "$mode"
    omp=${omp:-default} split=${split:-auto}
    name="glibc-$core$threads$([ "$omp" = passive ] && echo p)$([ "$split" != auto ] && echo "s$split")"
    echo "== $name: ours alone, --engine-core $core --threads $threads --omp-wait $omp," \
         "$TOP concurrent ($(($(date +%s) - start)) s)"
    timeout "$MODE_S" "$PY" -m bench.serve_bench --orgs S2 --concurrency "$TOP" \
        --prompt "$PROMPT" --output "$OUTPUT" --client ours --allocator glibc \
        --engine-core "$core" --threads "$threads" --omp-wait "$omp" --split-workers "$split" \
        --vllm-python /nonexistent --out "$OUT/${name}_ours.json" > "$OUT/${name}_ours.log" 2>&1 \
        || { echo "   failed or timed out (exit $?): see $OUT/${name}_ours.log"; continue; }
    rate=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['rows'][0]['output_tok_s'])" \
        "$OUT/${name}_ours.json")
    echo "   $rate output tok/s"
    if "$PY" -c "import sys; sys.exit(float(sys.argv[1]) <= float(sys.argv[2]))" "$rate" "$best"; then
        best=$rate OURS=(--engine-core "$core" --threads "$threads" --omp-wait "$omp"
                         --split-workers "$split")
    fi
done
[ -n "$MODES" ] && echo "== the full table serves ours with: ${OURS[*]:-the defaults}"
for alloc in $ALLOCATORS; do
    for client in ours vllm; do
        echo "== $alloc, $client client ($(($(date +%s) - start)) s)"
        timeout "$STEP_S" "$PY" -m bench.serve_bench --orgs S2 --concurrency "$CONC" \
            --prompt "$PROMPT" --output "$OUTPUT" --client "$client" --allocator "$alloc" \
            "${OURS[@]}" --out "$OUT/${alloc}_${client}.json" > "$OUT/${alloc}_${client}.log" 2>&1 \
            || echo "   failed or timed out after $STEP_S s (exit $?): see $OUT/${alloc}_${client}.log"
    done
done
echo "== kernel: paged vs contiguous decode ($(($(date +%s) - start)) s)"
timeout 240 "$PY" -m bench.kernel_bench --skip-generate --skip-tq4 "${KERNEL[@]}" \
    > "$OUT/kernel.log" 2>&1 && cp bench/results/kernels.json "$OUT/kernels.json" \
    || echo "   kernel bench failed or timed out: see $OUT/kernel.log"
echo "== done in $(($(date +%s) - start)) s, load average $(cut -d' ' -f1-3 /proc/loadavg)"
"$PY" -m bench.side_by_side "$OUT"
