#!/usr/bin/env bash
# Kernel A/B on a GPU machine in one call: builds `sluiced` at each git revision given
# (stripped and gzipped, about 6.6 MB each) into .ab/ (ignored by git), so several builds
# travel together, and prints the device command that runs `sluiced bench-kernels` of
# each in turn on one synthetic model, twice, alternating (a GPU's clocks drift between
# runs). Back here, `--compare DIR` prints each kernel's time per build side by side from
# the JSON files that command wrote (DIR: where the device tool put them).
#
#   scripts/gpu-ab.sh REV [REV ...]      e.g. scripts/gpu-ab.sh HEAD~1 HEAD
#   scripts/gpu-ab.sh --compare DIR
#
# Revisions are built in temporary worktrees sharing target/ab, so only the workspace
# crates rebuild per revision. Uncommitted changes are not built: commit them first (a
# local branch is enough).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

if [ "${1:-}" = --compare ]; then
  [ $# -eq 2 ] || { echo "usage: $0 --compare DIR" >&2; exit 2; }
  python3 - "$2" <<'PY'
import glob, json, os, sys
runs = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    name = os.path.basename(f)[:-5]
    try:
        runs[name] = json.load(open(f))
    except ValueError:
        print(f"{name}: no JSON (see its .err)")
if not runs:
    sys.exit("no *.json in " + sys.argv[1])
names = list(runs)
first = runs[names[0]]
print(f"{'kernel':<24}" + "".join(f"{n:>16}" for n in names) + "   (us; / copy)")
for g in first["gemv"]:
    key = (g["dtype"], g["m"], g["k"], g["rows"])
    cells = []
    for n in names:
        h = next((x for x in runs[n]["gemv"] if (x["dtype"], x["m"], x["k"], x["rows"]) == key), None)
        cells.append(f"{h['seconds']*1e6:8.1f} ({h['vs_copy']:.2f})" if h else "-")
    print(f"{g['dtype']:>6} {g['m']:>5}x{g['k']:<5} r{g['rows']:<3}" + "".join(f"{c:>16}" for c in cells))
for a in first["attention"]:
    cells = []
    for n in names:
        b = next((x for x in runs[n]["attention"] if x["context"] == a["context"]), None)
        cells.append(f"{b['seconds']*1e6:8.1f}" if b else "-")
    print(f"{'attention ctx ' + str(a['context']):<24}" + "".join(f"{c:>16}" for c in cells))
for e in first.get("experts", []):
    key = (e["dtype"], e["rows"])
    cells = []
    for n in names:
        f = next((x for x in runs[n].get("experts", []) if (x["dtype"], x["rows"]) == key), None)
        cells.append(f"{f['seconds']*1e6:8.1f} ({f['vs_copy']:.2f})" if f else "-")
    print(f"{'experts ' + e['dtype'] + ' r' + str(e['rows']):<24}" + "".join(f"{c:>16}" for c in cells))
for s in first.get("resident_steps", []):
    cells = []
    for n in names:
        t = next((x for x in runs[n].get("resident_steps", []) if x["batch"] == s["batch"]), None)
        cells.append(f"{t['step_s']*1e3:8.3f} ms" if t else "-")
    print(f"{'resident step b' + str(s['batch']):<24}" + "".join(f"{c:>16}" for c in cells))
PY
  exit 0
fi

[ $# -ge 1 ] || { echo "usage: $0 REV [REV ...] | --compare DIR" >&2; exit 2; }
rm -rf .ab
mkdir -p .ab
names=()
for rev in "$@"; do
  sha=$(git rev-parse --short "$rev^{commit}")
  name="b-$sha"
  wt=$(mktemp -d)
  trap 'git worktree remove --force "$wt" 2>/dev/null || true' EXIT
  git worktree add --detach --quiet "$wt" "$sha"
  (cd "$wt" && CARGO_TARGET_DIR="$root/target/ab" cargo build --release --quiet -p sluice-daemon --bin sluiced)
  git worktree remove --force "$wt"
  objcopy --strip-debug "$root/target/ab/release/sluiced" ".ab/$name"
  gzip -9f ".ab/$name"
  names+=("$name")
  echo "$rev -> .ab/$name.gz ($(du -h ".ab/$name.gz" | cut -f1))"
done
list="${names[*]}"
cat <<MSG

Device command (carry [".ab"]; $(( ${#names[@]} * 2 )) JSON files come back, at most 8 a call):
cd .ab && for v in $list; do gunzip -kf \$v.gz && chmod +x \$v; done && cd .. && export LD_LIBRARY_PATH=\$(python3 -c 'import glob,os,nvidia;print(os.path.dirname(glob.glob(list(nvidia.__path__)[0]+"/**/libnvrtc.so*",recursive=True)[0]))'):/usr/local/cuda/lib64; s=\$HOME/.cache/sluice/stores/ab-synth; [ -f \$s/manifest.bin ] || .ab/${names[0]} synth -o \$s --size 2GiB --hidden 4096 --dtype bf16 --codec none >/dev/null; for r in 1 2; do for v in $list; do if timeout 90 .ab/\$v bench-kernels --model \$s --json > \$OUT/\$v-\$r.json 2> \$OUT/\$v-\$r.err; then rm \$OUT/\$v-\$r.err; echo \$v \$r ok; else echo \$v \$r failed; tail -3 \$OUT/\$v-\$r.err; fi; done; done
Then, here: scripts/gpu-ab.sh --compare /work/.device/N
MSG
