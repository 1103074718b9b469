#!/usr/bin/env bash
# A/B of decode settings on the device: runs `tessera bench` on one synthetic shape under
# each configuration in turn (ROUNDS times, alternating, so drift hits every setting alike)
# and prints each run's table rows under its label.
# Usage (device machine, after run.sh has unpacked the binaries):
#   bash bench/gpu/ab_decode.sh SHAPE "label=ENV=V ENV2=V2" "label2=..." ...
# e.g. bash bench/gpu/ab_decode.sh llama-3-8b-v49k "base=TESSERA_PDL_CHAIN=0" "new="
# BATCHES (default 1,4), ROUNDS (default 2), EXTRA (more `tessera bench` arguments).
# A word AB_BIN=DIR among a label's settings runs DIR/tessera for that label (A/B of two
# builds, e.g. a kernel change that cannot be switched by an environment variable).
set -uo pipefail
SHAPE=$1
shift
BIN=${BIN:-/tmp/tessera-gpu-bin}
for round in $(seq "${ROUNDS:-2}"); do
    for cfg in "$@"; do
        label=${cfg%%=*}
        vars=${cfg#*=}
        echo "== $label (round $round): $vars"
        bin=$BIN
        for w in $vars; do [[ $w == AB_BIN=* ]] && bin=${w#AB_BIN=}; done
        # shellcheck disable=SC2086  # vars is a list of NAME=VALUE words
        env $vars "$bin/tessera" bench --device cuda --synthetic "$SHAPE" --prompts 512 \
            --batches "${BATCHES:-1,4}" --gen-tokens 64 ${EXTRA:-} 2>&1 | grep -E '^\|' | sed "s/^/$label r$round /"
    done
done
