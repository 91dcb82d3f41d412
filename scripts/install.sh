#!/usr/bin/env bash
# Create .venv and install prime-node into it with the torch build that fits this machine.
#   scripts/install.sh          the agent
#   scripts/install.sh dev      the agent plus test and lint tools
# torch is installed first, on its own, because a plain `torch` requirement resolves to the CUDA build
# (several GB) on Linux. Without an NVIDIA GPU we ask for the pinned CPU build instead; set
# PRIME_NODE_TORCH to override the requirement (e.g. "torch==2.13.0 --index-url <your CPU wheel index>").
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS=0
extras=${1:-}
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    if [ -n "${PRIME_NODE_TORCH:-}" ]; then
        torch_requirement=$PRIME_NODE_TORCH
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        torch_requirement="torch"                # GPU machine: the normal (CUDA) build
    else
        torch_requirement="torch==2.13.0"        # CPU machine: the CPU build (a local wheel here)
    fi
    echo "installing ${torch_requirement} ..."
    # shellcheck disable=SC2086  # the requirement may carry pip flags on purpose
    "${pip[@]}" $torch_requirement
fi

echo "installing prime-node${extras:+[$extras]} ..."
"${pip[@]}" -e ".${extras:+[$extras]}"
# The test tools: the NAT tests (tests/p2p/test_nat_netns.py) put peers behind iptables MASQUERADE in
# network namespaces. As root with apt, install iptables for them; otherwise those tests skip.
if [ "$extras" = dev ] && ! command -v iptables >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing iptables (for the NAT tests) ..."
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables >/dev/null) \
            || echo "install: iptables could not be installed; the NAT netns tests will skip"
    else
        echo "install: no iptables (it needs root and apt-get); the NAT netns tests will skip"
    fi
fi
echo "install: done in ${SECONDS}s"
