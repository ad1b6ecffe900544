#!/usr/bin/env bash
# Clones the CUTLASS commit pinned in third_party/cutlass.pin into third_party/cutlass (git-ignored),
# which setup.py then prefers to the nvidia-cutlass wheel. Only that commit is fetched (no history).
# Re-running is safe: an existing checkout at the pinned commit is kept, any other one is refused.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
pin="$root/third_party/cutlass.pin"
dest="$root/third_party/cutlass"
value() { sed -n "s/^$1=//p" "$pin"; }
url="$(value url)"; tag="$(value tag)"; commit="$(value commit)"
[[ -n "$url" && -n "$commit" ]] || { echo "error: $pin must set url= and commit=" >&2; exit 1; }

if [[ -e "$dest" ]]; then
  have="$(git -C "$dest" rev-parse HEAD 2>/dev/null || true)"
  if [[ "$have" == "$commit" ]]; then
    echo "third_party/cutlass is already at $tag ($commit)"
    exit 0
  fi
  echo "error: $dest exists but is not a checkout of $commit (found: ${have:-no git checkout});" \
       "remove it and run this script again" >&2
  exit 1
fi

tmp="$dest.partial"
rm -rf "$tmp"
git init -q "$tmp"
git -C "$tmp" remote add origin "$url"
git -C "$tmp" fetch -q --depth 1 origin "$commit"
git -C "$tmp" -c advice.detachedHead=false checkout -q FETCH_HEAD
have="$(git -C "$tmp" rev-parse HEAD)"
[[ "$have" == "$commit" ]] || { echo "error: fetched $have, expected $commit" >&2; exit 1; }
mv "$tmp" "$dest"
echo "third_party/cutlass: $tag ($commit)"
