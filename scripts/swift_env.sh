#!/usr/bin/env bash
# Make the separate Python environment that `autotune search --runner swift` drives.
#
# Why a separate venv: ms-swift pins its own trl (4.6.0 pins trl 0.29.1, transformers 5.19), which
# conflicts with the TRL that autotune's own worker uses. autotune only runs its `swift` script as a
# subprocess, so the two never share an interpreter.
#
# ms-swift 4.6.0 imports msgspec in its RLHF trainers without declaring it (swift rlhf fails with
# "No module named 'msgspec'"), so it is installed beside it.
#
# search_spaces/swift.yaml searches ZeRO stages and offload, and --quantization loads the base with
# bitsandbytes: ms-swift declares neither, so DeepSpeed (the version the main environment's CPU ZeRO
# tests use, installed with DS_BUILD_OPS=0: its ops compile on first use) and bitsandbytes go in too.
#
# Idempotent: when the venv already holds the wanted ms-swift, DeepSpeed and bitsandbytes it does
# nothing; a venv that has ms-swift but lacks the others (made by an older version of this script)
# gets only what is missing.
#   AUTOTUNE_SWIFT_VENV       where to put it (default ~/.cache/autotune/swift-venv)
#   AUTOTUNE_SWIFT_VERSION    ms-swift version (default 4.6.0)
#   AUTOTUNE_SWIFT_TORCH      torch version (default 2.13.0)
#   AUTOTUNE_SWIFT_DEEPSPEED  DeepSpeed version (default 0.19.8)
# Prints the path of the swift script on its last line; pass it as --swift-bin or AUTOTUNE_SWIFT_BIN.
set -euo pipefail
venv="${AUTOTUNE_SWIFT_VENV:-$HOME/.cache/autotune/swift-venv}"
version="${AUTOTUNE_SWIFT_VERSION:-4.6.0}"
torch_version="${AUTOTUNE_SWIFT_TORCH:-2.13.0}"
deepspeed_version="${AUTOTUNE_SWIFT_DEEPSPEED:-0.19.8}"
extras=("deepspeed==$deepspeed_version" "bitsandbytes>=0.50" msgspec)
export PIP_QUIET="${PIP_QUIET:-1}" PIP_DISABLE_PIP_VERSION_CHECK=1

# "<ms-swift version> <deepspeed version>" as the venv's metadata has them (no import: deepspeed's
# import takes seconds); bitsandbytes and msgspec only need to be there
versions() {
    "$venv/bin/python" -c '
import importlib.metadata as m
for name in ("bitsandbytes", "msgspec"):
    m.version(name)
print(m.version("ms-swift"), m.version("deepspeed"))' 2>/dev/null
}

installed() {
    [ -x "$venv/bin/swift" ] && [ -x "$venv/bin/python" ] &&
        [ "$(versions)" = "$version $deepspeed_version" ]
}

has_swift() {
    [ -x "$venv/bin/swift" ] &&
        [ "$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("ms-swift"))' 2>/dev/null)" = "$version" ]
}

export DS_BUILD_OPS=0
if installed; then
    echo "ms-swift $version, deepspeed $deepspeed_version and bitsandbytes already installed in $venv" >&2
elif has_swift; then
    echo "adding deepspeed $deepspeed_version and bitsandbytes to ms-swift $version in $venv" >&2
    "$venv/bin/python" -m pip install "torch==$torch_version" "${extras[@]}"
    installed || { echo "deepspeed $deepspeed_version or bitsandbytes did not install into $venv" >&2; exit 1; }
else
    echo "installing ms-swift $version, torch $torch_version, deepspeed and bitsandbytes into $venv (a few minutes)" >&2
    mkdir -p "$(dirname "$venv")"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --upgrade pip
    "$venv/bin/python" -m pip install "torch==$torch_version" "ms-swift==$version" "${extras[@]}"
    installed || { echo "ms-swift $version did not install into $venv" >&2; exit 1; }
fi
echo "$venv/bin/swift"
