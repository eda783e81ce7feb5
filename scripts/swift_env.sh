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
# Idempotent: when the venv already holds the wanted ms-swift version it does nothing.
#   AUTOTUNE_SWIFT_VENV      where to put it (default ~/.cache/autotune/swift-venv)
#   AUTOTUNE_SWIFT_VERSION   ms-swift version (default 4.6.0)
#   AUTOTUNE_SWIFT_TORCH     torch version (default 2.13.0)
# Prints the path of the swift script on its last line; pass it as --swift-bin or AUTOTUNE_SWIFT_BIN.
set -euo pipefail
venv="${AUTOTUNE_SWIFT_VENV:-$HOME/.cache/autotune/swift-venv}"
version="${AUTOTUNE_SWIFT_VERSION:-4.6.0}"
torch_version="${AUTOTUNE_SWIFT_TORCH:-2.13.0}"
export PIP_QUIET="${PIP_QUIET:-1}" PIP_DISABLE_PIP_VERSION_CHECK=1

installed() {
    [ -x "$venv/bin/swift" ] && [ -x "$venv/bin/python" ] &&
        [ "$("$venv/bin/python" -c 'import importlib.metadata as m, msgspec; print(m.version("ms-swift"))' 2>/dev/null)" = "$version" ]
}

if installed; then
    echo "ms-swift $version already installed in $venv" >&2
else
    echo "installing ms-swift $version and torch $torch_version into $venv (a few minutes)" >&2
    mkdir -p "$(dirname "$venv")"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --upgrade pip
    "$venv/bin/python" -m pip install "torch==$torch_version" "ms-swift==$version" msgspec
    installed || { echo "ms-swift $version did not install into $venv" >&2; exit 1; }
fi
echo "$venv/bin/swift"
