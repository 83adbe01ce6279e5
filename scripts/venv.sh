#!/usr/bin/env bash
# Creates (or reuses) one of the test command's PyTorch 2 worlds: a virtual
# environment with the exact versions of a pin list, beside Debian's torch
# 1.13. scripts/venv-torch2.txt (the default): PyTorch 2.13 CPU,
# transformers 4, accelerate, ...; scripts/venv-hf5.txt: the same torch
# with transformers 5.
#   scripts/venv.sh [DIR [PINS [BASE]]]
#                                  DIR defaults to build/venv-torch2,
#                                  PINS to scripts/venv-torch2.txt; BASE, a
#                                  complete venv of this script, is where
#                                  DIR's packages start from (hard links),
#                                  so pip installs only what PINS change
# Prints DIR/bin/python on success, nothing else on stdout.
#
# The interpreter is Debian's /usr/bin/python3 (3.11, the ABI of the
# cp311 torch wheel), never the first python3 on PATH: its venv module
# comes with python3-venv (scripts/deps.sh test). The venv does not see
# Debian's site-packages, so nothing of torch 1.13 leaks in.
#
# A complete venv holds a stamp (the interpreter's version and the pin
# list); while the stamp matches, a rerun reuses the venv in well under a
# second. Anything else (no stamp: an interrupted creation; other pins)
# rebuilds it from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build/venv-torch2}
req=${2:-scripts/venv-torch2.txt}
base=${3:-}
py=/usr/bin/python3
stamp=$dir/factorps-venv.stamp
if [[ -n $base && ! -f $base/factorps-venv.stamp ]]; then
  echo "venv: $base is not a complete venv of scripts/venv.sh" >&2
  exit 1
fi

want=$({ "$py" -c 'import sys; print(sys.version.split()[0])'; grep -v '^#' "$req"
         [[ -z $base ]] || { echo "base:"; cat "$base/factorps-venv.stamp"; }; })
if [[ -x $dir/bin/python && -f $stamp ]] && [[ $(cat "$stamp") == "$want" ]]; then
  echo "$dir/bin/python"
  exit 0
fi

echo "venv: creating $dir (pins: $req)" >&2
start=$SECONDS
rm -rf "$dir"
mkdir -p "$(dirname "$dir")"
log=$dir.log
site=lib/python$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')/site-packages
# From BASE: its packages as hard links (one copy of torch on disk, and
# nothing downloaded twice on a machine that has no local wheels); pip
# replaces files, never writes into them, so BASE stays as it was.
if ! { "$py" -m venv "$dir" &&
       { [[ -z $base ]] || cp -alf "$base/$site/." "$dir/$site/" 2>/dev/null ||
         cp -af "$base/$site/." "$dir/$site/"; } &&
       "$dir/bin/python" -m pip install --no-input --disable-pip-version-check -r "$req" &&
       "$dir/bin/python" -m pip check; } >"$log" 2>&1; then
  tail -n 30 "$log" >&2
  echo "venv: creating $dir failed (whole log: $log)" >&2
  exit 1
fi
# The pins name what must be there: check the imports, and that torch is
# the CPU build (a CUDA wheel would be several GB and useless here).
"$dir/bin/python" - "$req" <<'EOF' >&2
import importlib.metadata as md, sys
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, version = line.split("==")
        have = md.version(name)
        assert have.split("+")[0] == version, f"{name}: {have} installed, {version} pinned"
import torch, transformers, accelerate  # noqa: E401,F401
print(f"venv: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"accelerate {accelerate.__version__}")
if torch.version.cuda is not None:
    # A machine whose pip sees no CPU wheel (a fresh Debian: PyPI has only
    # the CUDA build) gets this one: it runs on the CPU all the same.
    print(f"venv: note: torch {torch.__version__} is the CUDA {torch.version.cuda} build (several GB): pip "
          "found no CPU wheel; for it, point pip at one (PIP_FIND_LINKS=DIR holding "
          f"torch-{torch.__version__.split('+')[0]}+cpu, or PIP_INDEX_URL=https://download.pytorch.org/whl/cpu) and remove the venv")
EOF
echo "$want" >"$stamp"
echo "venv: ready in $((SECONDS - start)) s" >&2
echo "$dir/bin/python"
