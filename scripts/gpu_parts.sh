#!/usr/bin/env bash
# Plan the GPU machine's unpack calls so that each fits the 64 MiB a call carries beside the tree.
#   ../shared/gpu/pack.sh && bash scripts/gpu_parts.sh
# A call sends the checkout's tracked and untracked-not-ignored files (mostly results/) plus what it
# carries. Each part of .gpu/pN/part.tar.xz that does not fit beside the tree is split into as many
# pieces as it takes (.gpu/pNa, .gpu/pNb, ...); the printed calls join them there and run its unpack.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
limit=$((64 * 1024 * 1024))
margin=$((512 * 1024))   # file metadata and rounding of what the tool counts
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | { xargs -0 -r stat -c %s -- 2>/dev/null || true; } \
        | awk '{s += $1} END {print s + 0}')   # a file moved aside does not travel
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
  pieces=$(( (size + room - 1) / room ))
  [ "$pieces" -le 26 ] || { echo "$dir: $size B would take $pieces calls" >&2; exit 1; }
  rm -rf "$dir"[a-z] && mkdir -p /tmp/gpu_parts_split && rm -f /tmp/gpu_parts_split/piece.*
  split -n "$pieces" -d -a 2 "$dir/part.tar.xz" /tmp/gpu_parts_split/piece.
  last=$(printf '%02d' $((pieces - 1)))
  k=0
  for piece in /tmp/gpu_parts_split/piece.*; do
    sub="$dir$(printf "\\$(printf '%03o' $((97 + k)))")"
    mkdir -p "$sub" && mv "$piece" "$sub/"
    name=$(basename "$piece")
    n=$((n + 1))
    if [ "$k" -eq 0 ]; then
      echo "call $n: carry [\"$sub\"]: mkdir -p /tmp/$part && cp $sub/$name /tmp/$part/"
    elif [ "$name" != "piece.$last" ]; then
      echo "call $n: carry [\"$sub\"]: cp $sub/$name /tmp/$part/"
    else
      cp "$dir/unpack.sh" "$sub/unpack.sh"
      echo "call $n: carry [\"$sub\"]: cat /tmp/$part/piece.* $sub/$name > /tmp/$part/part.tar.xz" \
        "&& cp $sub/unpack.sh /tmp/$part/ && bash /tmp/$part/unpack.sh && rm -f /tmp/$part/piece.* /tmp/$part/part.tar.xz"
    fi
    k=$((k + 1))
  done
done
echo "each call within 30 s of the previous one's end (the machine stays warm that long); then, in the last"
echo "call or the next: export LAB_GIT_COMMIT=\$(git rev-parse --short HEAD); bash scripts/device_run.sh '<lab args>' ..."
