#!/usr/bin/env bash
# A/B of CPU-engine settings on the device host's cores (issue 3 on a many-core server):
# `tessera bench` (CPU) on SmolLM2 under each configuration in turn, ROUNDS times
# alternating, at each thread count of THREAD_LIST; with PROFILE=1 the per-op table
# (TESSERA_CPU_OP_PROFILE) of the decode test too.
# Usage (device machine; /tmp/smollm2.gguf assembled from the carried halves, BIN/tessera):
#   bash bench/gpu/cpu_ab.sh "label=ENV=V ..." "label2=..." ...
set -uo pipefail
BIN=${BIN:-/tmp/tessera-gpu-bin}
M=${MODEL:-/tmp/smollm2.gguf}
for round in $(seq "${ROUNDS:-2}"); do
    for t in ${THREAD_LIST:-16}; do
        for cfg in "$@"; do
            label=${cfg%%=*}
            vars=${cfg#*=}
            # shellcheck disable=SC2086  # vars is a list of NAME=VALUE words
            out=$(env CUDA_VISIBLE_DEVICES= TESSERA_CPU_OP_PROFILE=${PROFILE:-0} $vars "$BIN/tessera" bench --model "$M" \
                --threads "$t" --prompt-tokens 128 --gen-tokens 64 --repetitions 3 2>&1)
            echo "$label r$round t=$t: $(grep -E '\| (pp|tg)[0-9]+ \|' <<<"$out" | cut -d'|' -f4,5 | tr '\n' ' ')"
            [[ ${PROFILE:-0} == 1 ]] && sed -n '/| tg64: op/,/outside the ops/p' <<<"$out" | grep -v '^|---' | \
                awk -F'|' -v l="$label" '{printf "  %s %s:%s\n", l, $2, $5}' | tr -s ' '
        done
    done
done
true  # the last PROFILE test must not become the exit status
