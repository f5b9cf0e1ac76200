#!/usr/bin/env bash
# Plan the GPU machine's unpack calls so that each fits the 64 MiB a call carries beside the tree.
#   ../shared/gpu/pack.sh && bash scripts/gpu_parts.sh
# A call sends the checkout's tracked and untracked-not-ignored files (mostly results/) plus what it
# carries. Each part of .gpu/pN/part.tar.xz that does not fit beside the tree is split into halves
# (.gpu/pNa, .gpu/pNb); the printed calls join them there and run the part's own unpack.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
limit=$((64 * 1024 * 1024))
margin=$((512 * 1024))   # file metadata and rounding of what the tool counts
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s -- 2>/dev/null \
        | awk '{s += $1} END {print s + 0}')
room=$((limit - tree - margin))
echo "tree: $tree B; room per call for carried files: $room B"
n=0
for dir in .gpu/p[0-9]; do
  [ -f "$dir/part.tar.xz" ] || continue
  size=$(stat -c %s "$dir/part.tar.xz")
  part=$(basename "$dir")
  if [ "$size" -le "$room" ]; then
    n=$((n + 1)); echo "call $n: carry [\"$dir\"]: bash $dir/unpack.sh"
    continue
  fi
  [ $((size / 2 + 1)) -le "$room" ] || { echo "$dir: half of $size B does not fit either" >&2; exit 1; }
  rm -rf "$dir"a "$dir"b && mkdir -p "$dir"a "$dir"b
  split -n 2 -d "$dir/part.tar.xz" "$dir"a/half.
  mv "$dir"a/half.01 "$dir"b/half.01
  cp "$dir/unpack.sh" "$dir"b/unpack.sh
  n=$((n + 1)); echo "call $n: carry [\"${dir}a\"]: mkdir -p /tmp/$part && cp ${dir}a/half.00 /tmp/$part/"
  n=$((n + 1)); echo "call $n: carry [\"${dir}b\"]: cat /tmp/$part/half.00 ${dir}b/half.01 > /tmp/$part/part.tar.xz" \
    "&& cp ${dir}b/unpack.sh /tmp/$part/ && bash /tmp/$part/unpack.sh && rm -f /tmp/$part/half.* /tmp/$part/part.tar.xz"
done
echo "each call within 30 s of the previous one's end (the machine stays warm that long); then, in the last"
echo "call or the next: export LAB_GIT_COMMIT=\$(git rev-parse --short HEAD); bash scripts/device_run.sh '<lab args>' ..."
