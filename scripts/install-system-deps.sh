#!/usr/bin/env bash
# Installs the system libraries kvxfer needs and that are missing: Mooncake Transfer Engine's
# wheels link against libibverbs (RDMA verbs), even when only its TCP transport is used.
set -euo pipefail
missing=()
for pkg in libibverbs1; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "kvxfer needs ${missing[*]} (libibverbs); install it with your system's package manager." >&2
  exit 1
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing system packages: ${missing[*]}"
# Two environments built at once (make -j, or make test beside make test-e2e) each run this:
# the second waits for the first's apt lock instead of failing.
lock=(-o DPkg::Lock::Timeout=600)
$sudo apt-get "${lock[@]}" update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get "${lock[@]}" install -y -qq "${missing[@]}"
