#!/usr/bin/env bash
# Debian packages the cluster tests (tests/cluster) need on the CI machine: sshd for the fake
# nodes, docker.io (dockerd per node), debootstrap (the locally built base image: no registry
# is reachable), iproute2 (bridge, veths, netns), util-linux (nsenter/unshare), git-lfs (so the
# setup's install step finds it present and never runs apt on the shared test machine),
# slurm-wlm and munge (a real Slurm across the fake nodes: tests/cluster/slurm.py).
# Idempotent and non-interactive; needs root. Usage: bash .ci/cluster_deps.sh
set -euo pipefail
PKGS=(openssh-server openssh-client docker.io debootstrap iproute2 util-linux procps git-lfs ca-certificates
      slurm-wlm munge)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then echo "cluster deps: all present"; exit 0; fi
[ "$(id -u)" = 0 ] || { echo "cluster deps: need root to install: ${missing[*]}" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
# Packages' postinst scripts must not start system services here (no init system; the test
# fixture starts its own sshd and dockerd per fake node): a temporary policy-rc.d says "deny".
made_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; made_policy=1
fi
trap '[ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d' EXIT
apt-get update -q -o Acquire::Retries=3
apt-get install -y -q --no-install-recommends -o Dpkg::Options::=--force-confold "${missing[@]}"
echo "cluster deps: installed ${missing[*]}"
