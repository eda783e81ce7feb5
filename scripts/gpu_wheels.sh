#!/usr/bin/env bash
# The wheels a lent GPU machine lacks for scripts/gpu_checks.sh, fetched here into .whl/ (git-ignored
# through .git/info/exclude): that machine has torch, transformers, peft and accelerate but no
# registry, and a call carries at most 64 MiB. Its Python is 3.12, its torch a CUDA 13.0 build, so
# bitsandbytes keeps only its CUDA 13.0 library (43 MB -> 3.6 MB) and deepspeed is built here with
# DS_BUILD_OPS=0 (its ops compile there on first use). About 25 MB in all; the versions are the ones
# the third lease ran (docs/gpu-validation.md).
#
#   bash scripts/gpu_wheels.sh
#
# then, on the device, begin the command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
# and carry ".whl".
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
mkdir -p .whl
PLATFORMS=()
for p in manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  PLATFORMS+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" --platform manylinux2014_x86_64 -d .whl \
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  optuna==5.0.0 alembic==1.20.1 SQLAlchemy==2.1.9 Mako==1.4.3 colorlog==6.12.0 plotly==7.1.0 \
  hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  bitsandbytes==0.50.2
zip -q -d .whl/bitsandbytes-0.50.2-*.whl 'bitsandbytes/libbitsandbytes_cuda1[12]*.so' \
  'bitsandbytes/libbitsandbytes_cuda132.so' 'bitsandbytes/libbitsandbytes_rocm*' \
  'bitsandbytes/libbitsandbytes_xpu*' || true
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
du -sh .whl
