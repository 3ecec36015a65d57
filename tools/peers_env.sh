#!/usr/bin/env bash
# tools/peers_env.sh [DIR]: build the side environment that tools/bench_peers.py runs in.
#
# The peers' code (NVlabs/Fast-dLLM, ML-GSAI/LLaDA, JetAstra/SDAR) needs the transformers it was
# written for (SDAR's modeling file: 4.52/4.53), which the project's own .venv (transformers 5)
# cannot hold. DIR (default /tmp/peers/venv) is a venv of its own that inherits nothing from
# .venv: torch as the Makefile installs it, this repository (editable, with its dependencies) and
# transformers 4.53.3 with the huggingface-hub and tokenizers it works with, plus einops (Fast-dLLM).
# A layered venv that sees .venv's site-packages breaks: transformers 5 pulls `kernels`, which
# needs huggingface-hub >= 1, and the peers' transformers 4.53.3 imports it when it is there.
#
#   tools/peers_env.sh /tmp/peers/venv
#   /tmp/peers/venv/bin/python tools/bench_peers.py --quick --fast-dllm ... --llada ... --sdar ...
#
# PYTHON (default python3) makes the venv; TORCH (default torch==2.13.0, CI's) is what pip installs
# for torch (e.g. a CUDA build's requirement). Re-running it on an existing DIR updates it.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${1:-/tmp/peers/venv}
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}

if [[ ! -x "$DIR/bin/python" ]]; then
    "$PYTHON" -m venv "$DIR"
fi
PIP=("$DIR/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" "$TORCH"
"${PIP[@]}" -e "$ROOT" "transformers==4.53.3" "huggingface-hub>=0.30,<1.0" "tokenizers>=0.21,<0.22" einops
# nothing of transformers 5's stack may be importable here
"$DIR/bin/python" - <<'PY'
import importlib.util, sys
import transformers, huggingface_hub, stabledrl_mcore
assert transformers.__version__ == "4.53.3", transformers.__version__
assert int(huggingface_hub.__version__.split(".")[0]) == 0, huggingface_hub.__version__
assert importlib.util.find_spec("kernels") is None, "kernels is installed: transformers 4.53.3 would import it"
print(f"peers environment ready: {sys.prefix} (python {sys.version.split()[0]}, transformers "
      f"{transformers.__version__}, huggingface-hub {huggingface_hub.__version__})")
PY
