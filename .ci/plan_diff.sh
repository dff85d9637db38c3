#!/bin/bash
# Compares what `graphc plan` writes for the examples (GPT on 8 ranks with and without bf16,
# GPT ZeRO-3 on pp2 x dp2, hybrid, pipeline under 1f1b and gpipe: plans, stage programs,
# histories, guards) in two source trees, ignoring object addresses, pass timings and the
# compile key's hash of graphc's own sources. A pure move of code must print IDENTICAL.
#   bash .ci/plan_diff.sh OLD_TREE NEW_TREE OUT_DIR      (about 30 s a tree on 2 cores)
set -u
old=$(realpath "$1"); new=$(realpath "$2"); out=$(realpath -m "$3")
plans() {   # plans TREE DIR
    rm -rf "$2"; mkdir -p "$2"
    run() { tree=$1; dir=$2; name=$3; script=$4; n=$5; shift 5
        (cd "$tree" && PYTHONPATH="$tree" timeout 600 python -m graphc plan "$script" --nproc "$n" \
            --out "$dir/$name" --no-chart -- "$@" > "$dir/$name.stdout" 2>&1) || echo "FAILED $name in $tree"; }
    run "$1" "$2" gpt8 examples/gpt.py 8 --pp 2 --tp 2 --dp 2
    run "$1" "$2" gpt8amp examples/gpt.py 8 --pp 2 --tp 2 --dp 2 --amp bf16
    run "$1" "$2" gpt4zero3 examples/gpt.py 4 --pp 2 --dp 2 --zero 3
    run "$1" "$2" hybrid examples/hybrid.py 4
    run "$1" "$2" pipeline examples/pipeline.py 2
    run "$1" "$2" pipeline_gpipe examples/pipeline.py 2 --schedule gpipe
}
norm() {    # every file of DIR, masked
    find "$1" -type f | sort | while read -r f; do
        echo "### ${f#"$1"/}"
        sed -E "s#$1#OUT#g; s/0x[0-9a-f]+/0xADDR/g; s/\(took [0-9.]+ (ms|s)\)/(took T)/g" "$f" |
            sed -E "s/\('graphc and torch', '[0-9a-f]+'\)/('graphc and torch', HASH)/"
    done
}
plans "$old" "$out/old"; plans "$new" "$out/new"
diff <(norm "$out/old") <(norm "$out/new") && echo "IDENTICAL: $(find "$out/new" -type f | wc -l) files"
