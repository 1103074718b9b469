#!/usr/bin/env bash
# A/B of serving settings on the device: `tessera serve --device cuda` on MODEL under each
# configuration in turn, driven by bench/loadgen.py (128-token prompts, 128 generated,
# streaming) at each concurrency; prints loadgen's table rows under each label.
# Usage (device machine, after run.sh has unpacked the binaries):
#   CONC="1 16" DURATION=15 bash bench/gpu/serve_ab.sh MODEL "label=ENV=V ..." "label2=..."
# e.g. bash bench/gpu/serve_ab.sh /tmp/smollm2.gguf "off=TESSERA_LOOKAHEAD=0" "on=X=1"
# SERVE_ARGS adds arguments to every `tessera serve` (e.g. "--tp 2"). A configuration's
# AB_BIN=DIR runs DIR/tessera instead of $BIN/tessera (an A/B of two builds, e.g.
# "new=X=1" "old=AB_BIN=/tmp/old").
set -uo pipefail
MODEL=$1
shift
BIN=${BIN:-/tmp/tessera-gpu-bin}
H=--header
for cfg in "$@"; do
    label=${cfg%%=*}
    vars=${cfg#*=}
    bin=$BIN
    for v in $vars; do [[ $v == AB_BIN=* ]] && bin=${v#AB_BIN=}; done
    # shellcheck disable=SC2086  # vars is a list of NAME=VALUE words, SERVE_ARGS of arguments
    env $vars "$bin/tessera" serve --device cuda --model "$MODEL" --port 8127 ${SERVE_ARGS:-} >"/tmp/serve-ab-$label.log" 2>&1 &
    p=$!
    for _ in $(seq 240); do curl -sf localhost:8127/ready >/dev/null && break; sleep 0.5; done
    for c in ${CONC:-1 16}; do
        python3 bench/loadgen.py --url http://127.0.0.1:8127 --concurrency "$c" --duration "${DURATION:-15}" \
            --prompt-tokens 128 --max-tokens 128 --ignore-eos --label "$label c=$c" $H
        H=
    done
    kill $p
    wait $p 2>/dev/null
done
