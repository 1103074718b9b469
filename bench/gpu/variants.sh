# Shared by bench/gpu/fused_modes.sh and decode_attn.sh (sourced, not run): edited copies of
# one kernel source, a benchmark program built against each, and its runs.
#
#   variant_copy NAME SRC DST <<'PY' ... PY
#
# Runs the Python edits on stdin against SRC's text `s`, with `v` = NAME and sub(old, new)
# replacing `old`, which must occur exactly once (else the edit no longer applies: an
# AssertionError naming it), and writes the result to DST.
variant_copy() {
    local edits prelude
    edits=$(cat)
    prelude='import os, sys
s = open(sys.argv[1]).read()
v = os.environ["V"]
def sub(old, new):
    global s
    assert s.count(old) == 1, f"{v}: {old!r} found {s.count(old)} times"
    s = s.replace(old, new)'
    mkdir -p "$(dirname "$3")"
    V=$1 python3 -c "$prelude
$edits
open(sys.argv[2], 'w').write(s)" "$2" "$3"
}
#
#   variants_build_run PROG MACRO FILE [ARGS...]
#
# For each name in $VARIANTS, the caller's `make_variant NAME` writes the edited copy to
# $D/NAME/FILE; a variant whose edit no longer applies is reported (its log) and skipped.
# EXTRA="name=/path/to/FILE ..." adds copies made elsewhere. Every copy is compiled into
# $D/NAME/PROG from bench/gpu/PROG.cu with -DMACRO pointing at it (in parallel), then each
# build runs with ARGS in turn, under a "=== NAME" line (or its build log if it failed).
# Run from the repository root.
variants_build_run() {
    local prog=$1 macro=$2 file=$3 v e p
    shift 3
    local names=$VARIANTS pids=()
    build() { # name, source copy
        nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I"$PWD/kernels/cuda" -D"$macro=\"$2\"" \
            -o "$D/$1/$prog" "bench/gpu/$prog.cu" > "$D/$1/build.log" 2>&1 &
        pids+=($!)
    }
    for v in $VARIANTS; do
        mkdir -p "$D/$v"
        if make_variant "$v" > "$D/$v/build.log" 2>&1; then build "$v" "$D/$v/$file"; fi
    done
    for e in ${EXTRA:-}; do
        v=${e%%=*}
        mkdir -p "$D/$v"
        names="$names $v"
        build "$v" "${e#*=}"
    done
    for p in "${pids[@]}"; do wait "$p" || true; done
    for v in $names; do
        echo "=== $v"
        if [[ -x "$D/$v/$prog" ]]; then "$D/$v/$prog" "$@"; else cat "$D/$v/build.log"; fi
    done
}
