#!/usr/bin/env bash
# Make a Debian base image for the Dockerfiles from Debian packages alone: no image
# registry needed, only a Debian mirror (docs/deploy-compose.md, "Building without an image registry").
#
#   scripts/docker-base.sh                       duplexserve-base:bookworm (python3, venv)
#   scripts/docker-base.sh --tag NAME --suite bookworm --mirror URL --include nginx
#
# Then build on it:
#   docker build -f docker/Dockerfile --build-arg PYTHON_IMAGE=duplexserve-base:bookworm ...
#
# mmdebstrap (Debian package mmdebstrap) makes a minbase root file system with Python 3,
# venv and the CA certificates, without documentation, man pages and translations (as
# Debian's -slim images), and `docker import` turns it into an image. With --ca-bundle
# (the default: this machine's /etc/ssl/certs/ca-certificates.crt), the image trusts what
# this machine trusts, so pip and apt in a build behind a TLS-inspecting proxy work.
# Run it as root (mmdebstrap's root mode), or as a user with subuids (its unshare mode).
set -euo pipefail

TAG=duplexserve-base:bookworm
SUITE=bookworm
MIRROR=()
PACKAGES=python3,python3-venv,python-is-python3,ca-certificates
EXTRA=""
CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
PIP_CONF=""

usage() {
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
  cat <<EOF
Options:
  --tag NAME          image name (default $TAG)
  --suite SUITE       Debian release (default $SUITE: its python3 is 3.11, as the package needs)
  --mirror URL        Debian mirror (default: mmdebstrap's)
  --include PKGS      more Debian packages, comma-separated (e.g. nginx)
  --packages PKGS     replace the default package set ($PACKAGES)
  --ca-bundle FILE    CA bundle to install as /etc/ssl/certs/ca-certificates.crt (default $CA_BUNDLE)
  --no-ca-bundle      keep Debian's own CA bundle
  --pip-conf FILE     install FILE as /etc/pip.conf (a private index or mirror for builds)
EOF
}

while [ $# -gt 0 ]; do
  case "$1" in
    --tag) TAG=$2; shift 2 ;;
    --suite) SUITE=$2; shift 2 ;;
    --mirror) MIRROR=("$2"); shift 2 ;;
    --include) EXTRA=$2; shift 2 ;;
    --packages) PACKAGES=$2; shift 2 ;;
    --ca-bundle) CA_BUNDLE=$2; shift 2 ;;
    --no-ca-bundle) CA_BUNDLE=""; shift ;;
    --pip-conf) PIP_CONF=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "docker-base.sh: unknown argument $1 (--help lists them)" >&2; exit 2 ;;
  esac
done

for tool in mmdebstrap docker; do
  command -v "$tool" >/dev/null || { echo "docker-base.sh: $tool not found (Debian package ${tool/docker/docker.io})" >&2; exit 1; }
done
if [ -n "$CA_BUNDLE" ] && [ ! -r "$CA_BUNDLE" ]; then
  echo "docker-base.sh: no CA bundle at $CA_BUNDLE (--ca-bundle FILE, or --no-ca-bundle)" >&2
  exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# As in Debian's own container images: a service that a package installs is not started,
# here or in a later image build (policy-rc.d says no; mmdebstrap's own one is temporary),
# and apt leaves no package cache in an image layer.
printf '#!/bin/sh\nexit 101\n' >"$tmp/policy-rc.d"
cat >"$tmp/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
Acquire::Languages "none";
EOF
hooks=(--skip=chroot/policy-rc.d
  --extract-hook="install -m 755 '$tmp/policy-rc.d' \"\$1/usr/sbin/policy-rc.d\""
  --extract-hook="install -m 644 '$tmp/docker-clean' \"\$1/etc/apt/apt.conf.d/docker-clean\"")
if [ -n "$CA_BUNDLE" ]; then
  hooks+=(--customize-hook="upload $CA_BUNDLE /etc/ssl/certs/ca-certificates.crt")
fi
if [ -n "$PIP_CONF" ]; then
  [ -r "$PIP_CONF" ] || { echo "docker-base.sh: cannot read $PIP_CONF" >&2; exit 1; }
  hooks+=(--customize-hook="upload $PIP_CONF /etc/pip.conf")
fi

start=$(date +%s)
# A tarball first, imported only when mmdebstrap succeeded (a pipe would import half a file).
mmdebstrap --variant=minbase --quiet \
  --include="$PACKAGES${EXTRA:+,$EXTRA}" \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  "${hooks[@]}" \
  "$SUITE" "$tmp/rootfs.tar" "${MIRROR[@]}"
docker import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  --message "scripts/docker-base.sh: Debian $SUITE minbase with $PACKAGES${EXTRA:+,$EXTRA}" \
  "$tmp/rootfs.tar" "$TAG" >/dev/null
size=$(docker image inspect --format '{{.Size}}' "$TAG")
echo "docker-base.sh: $TAG ($((size / 1000000)) MB) in $(($(date +%s) - start)) s"
